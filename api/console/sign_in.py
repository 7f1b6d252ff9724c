"""Signing in to the console with an API key, which opens a session in the store, and out, which ends it
(api/console/viewer.py); and the console's one script, which every page (the sign-in form too) loads."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import FileResponse, RedirectResponse, Response

from conveyor.api.console import viewer as viewers
from conveyor.api.console.pages import STATIC, CsrfField, ViewerDep, check_csrf, csrf_failed, page
from conveyor.api.deps import SessionDep
from conveyor.core.clock import utcnow
from conveyor.core.store import console_sessions

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
    """A shown key opens a new session (any session the browser held before ends: a sign-in never reuses
    a secret someone else may have planted)."""
    if not viewers.sign_in_token_ok(request, csrf):
        raise csrf_failed()
    found = viewers.key_for_plaintext(session, key.strip())
    if found is None:
        return page(request, "sign_in.html", None, error="That key is unknown or revoked.")
    earlier = viewers.session_secret(request)
    if earlier is not None:
        console_sessions.end(session, earlier)
    response = RedirectResponse("/console", status_code=303)
    secret = console_sessions.open_session(session, found.id, utcnow())
    viewers.keep_session(request, response, secret)
    return response


@router.post("/sign-out")
def sign_out(request: Request, viewer: ViewerDep, session: SessionDep, csrf: CsrfField = None) -> Response:
    """The session ends in the store, so its cookie opens nothing any more, wherever it was copied."""
    check_csrf(viewer, csrf)
    secret = viewers.session_secret(request)
    if secret is not None:
        console_sessions.end(session, secret)
    response = RedirectResponse("/console/sign-in", status_code=303)
    response.delete_cookie(viewers.SESSION_COOKIE, path="/console")
    return response
