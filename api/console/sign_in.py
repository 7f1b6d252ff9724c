"""Signing in to the console with an API key, and out (api/console/viewer.py: what the session holds); and
the console's one script, which every page (the sign-in form too) loads."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import FileResponse, RedirectResponse, Response

from conveyor.api.console import viewer as viewers
from conveyor.api.console.pages import STATIC, CsrfField, check_csrf, page
from conveyor.api.deps import SessionDep

router = APIRouter(prefix="/console", include_in_schema=False)


@router.get("/static/console.js")
def script() -> Response:
    """The console's one script (static/console.js), for signed-in and anonymous pages alike."""
    return FileResponse(STATIC / "console.js", media_type="text/javascript",
                        headers={"Cache-Control": "max-age=300", "X-Content-Type-Options": "nosniff"})


@router.get("/sign-in")
def sign_in_form(request: Request) -> Response:
    return page(request, "sign_in.html", None, error=None)


@router.post("/sign-in")
def sign_in(request: Request, session: SessionDep, key: Annotated[str, Form(max_length=200)],
            csrf: CsrfField = None) -> Response:
    check_csrf(request, csrf)
    found = viewers.key_for_plaintext(session, key.strip())
    if found is None:
        return page(request, "sign_in.html", None, error="That key is unknown or revoked.")
    response = RedirectResponse("/console", status_code=303)
    signed = viewers.signed_session(found, viewers.now_s())
    viewers.set_cookie(request, response, viewers.SESSION_COOKIE, signed, viewers.SESSION_S)
    return response


@router.post("/sign-out")
def sign_out(request: Request, csrf: CsrfField = None) -> Response:
    check_csrf(request, csrf)
    response = RedirectResponse("/console/sign-in", status_code=303)
    response.delete_cookie(viewers.SESSION_COOKIE, path="/console")
    return response
