"""What /console answers while the console is off (`console_enabled`, off by default): a 404 that says how
to turn it on, rather than a bare one."""

from __future__ import annotations

from fastapi import APIRouter

from conveyor.api.errors import ApiError

router = APIRouter(include_in_schema=False)
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"]
MESSAGE = ("the operator console is off: its operator turns it on with console_enabled "
           "(CONVEYOR_CONSOLE_ENABLED=true), and it is served at /console")


@router.api_route("/console", methods=METHODS)
@router.api_route("/console/{rest:path}", methods=METHODS)
def console_off() -> None:
    raise ApiError(404, "not_found", MESSAGE, None)
