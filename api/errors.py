"""One error shape everywhere: {"error": {"code": ..., "message": ..., "field": ...}}."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

LOCATIONS = ("body", "query", "path", "header", "cookie")
UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "url", "none"})


class ApiError(Exception):
    """An HTTP error raised by the API layer (never by the store)."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.headers = headers



def not_found(kind: str, object_id: str) -> ApiError:
    """The one 404 for an id the tenant cannot see, whether it is missing or another tenant's."""
    return ApiError(404, "not_found", f"id: {kind} {object_id} not found", "id")

def error_response(
    status: int, code: str, message: str, field: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = {"error": {"code": code, "message": message, "field": field}}
    return JSONResponse(body, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(OperationalError, _store_unavailable)
    app.add_exception_handler(Exception, _internal_error)


async def _api_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc.status, exc.code, exc.message, exc.field, exc.headers)


async def _validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first: dict[str, Any] = exc.errors()[0]
    field = field_name(first.get("loc", ()))
    message = f"{field}: {first.get('msg', 'invalid value')}" if field else str(first.get("msg"))
    return error_response(422, "invalid_request", message, field or None)


async def _http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return error_response(exc.status_code, code, str(exc.detail), None, getattr(exc, "headers", None))


async def _store_unavailable(_request: Request, _exc: Exception) -> JSONResponse:
    # Connection details stay in the server log: they may name hosts and users.
    return error_response(503, "store_unavailable", "the job store is unreachable; retry shortly", None,
                          {"Retry-After": "1"})


async def _internal_error(_request: Request, _exc: Exception) -> JSONResponse:
    return error_response(500, "internal_error", "internal server error")


def field_name(loc: tuple[Any, ...] | list[Any]) -> str:
    """('body', 'messages', 0, 'content') -> 'messages[0].content'; union member tags are dropped."""
    parts = list(loc[1:] if loc and loc[0] in LOCATIONS else loc)
    out = str(parts[0]) if parts else ""
    for part in parts[1:]:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_union_tag(str(part)):
            out += f".{part}"
    return out


def _is_union_tag(part: str) -> bool:
    """pydantic names the failing member of a union in loc: 'str', 'list[constrained-str]', 'WebhookSpec'."""
    return "[" in part or "-" in part or part in UNION_TAGS or part[:1].isupper()
