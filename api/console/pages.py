"""What every console page shares: the templates (Jinja2, autoescaped: a prompt holding HTML shows as text),
who is looking (a redirect to sign in when nobody is), the CSRF token each form carries and each POST must
return, and the filters the templates format with."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from markupsafe import Markup

from conveyor.api.console import viewer as viewers
from conveyor.api.console.viewer import Viewer
from conveyor.api.deps import ServicesDep, SessionDep
from conveyor.api.errors import ApiError, error_response
from conveyor.core.clock import utcnow

templates = Jinja2Templates(directory=Path(__file__).parent / "templates")
# No caching of what a viewer saw; no script but the console's own file (static/console.js), and no framing
# (a confirmation page cannot be clicked through from another site's frame).
PAGE_HEADERS = {"Cache-Control": "no-store", "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff",
                "Content-Security-Policy": "default-src 'none'; script-src 'self'; connect-src 'self'; "
                                           "style-src 'unsafe-inline'; img-src 'self'; form-action 'self'; "
                                           "frame-ancestors 'none'; base-uri 'none'"}
STATIC = Path(__file__).parent / "static"


class SignInRequired(Exception):
    """No valid session (auth on): the page answers with a redirect to the sign-in form."""


def to_sign_in(_request: Request, _exc: Exception) -> Response:
    return RedirectResponse("/console/sign-in", status_code=303)


async def api_error(request: Request, exc: Exception) -> Response:
    """An ApiError as a page under /console (what went wrong, in words), and as the API's JSON elsewhere."""
    assert isinstance(exc, ApiError)
    if not request.url.path.startswith("/console"):
        return error_response(exc.status, exc.code, exc.message, exc.field, exc.headers)
    return templates.TemplateResponse(request, "error.html", {"viewer": None, "status": exc.status,
                                                              "message": exc.message},
                                      status_code=exc.status, headers={**(exc.headers or {}), **PAGE_HEADERS})


def current_viewer(request: Request, services: ServicesDep, session: SessionDep) -> Viewer:
    """Who is looking: a key's session (auth on; none sends the browser to sign in), or anyone (auth off),
    whose first page opens the browser's session."""
    secret, now = viewers.session_secret(request), utcnow()
    if not services.settings.auth_enabled:
        return viewers.anonymous_viewer(session, secret, now, may_open=request.method in ("GET", "HEAD"))
    viewer = viewers.signed_in_viewer(session, secret, now)
    if viewer is None:
        raise SignInRequired
    return viewer


def current_admin(viewer: Annotated[Viewer, Depends(current_viewer)]) -> Viewer:
    """The fleet's pages (workers, tenants, purges) are every tenant's business: an admin's only."""
    if viewer.tenant is not None:
        raise ApiError(403, "admin_only", "this page needs an admin key (or auth off)", None)
    return viewer


ViewerDep = Annotated[Viewer, Depends(current_viewer)]
AdminDep = Annotated[Viewer, Depends(current_admin)]
CsrfField = Annotated[str | None, Form(alias="csrf")]


def page(request: Request, template: str, viewer: Viewer | None, **context: Any) -> HTMLResponse:
    """A page with the CSRF token its forms carry: the viewer's session's, or before any session (the
    sign-in form, an error) the sign-in form's own."""
    sign_in = viewers.sign_in_token(request) if viewer is None else None
    token = sign_in if viewer is None else viewer.csrf
    response = templates.TemplateResponse(request, template, {"viewer": viewer, "csrf": token, **context})
    if sign_in is not None:
        viewers.keep_sign_in_token(request, response, sign_in)
    if viewer is not None and viewer.opened is not None:
        viewers.keep_session(request, response, viewer.opened)
    response.headers.update(PAGE_HEADERS)
    return response


def confirmation(request: Request, viewer: Viewer, question: str, detail: str, action_url: str, button: str,
                 back_url: str, **fields: str) -> HTMLResponse:
    """The page every action goes through: what it will do, and the one form (with its CSRF token) that
    does it."""
    return page(request, "confirm.html", viewer, question=question, detail=detail, action_url=action_url,
                button=button, back_url=back_url, fields=fields)


def check_csrf(viewer: Viewer, submitted: str | None) -> None:
    """An action's form must carry its session's token (403 otherwise)."""
    if not viewers.csrf_ok(viewer.csrf, submitted):
        raise csrf_failed()


def csrf_failed() -> ApiError:
    message = "csrf: the form's token is missing or stale; reload the page"
    return ApiError(403, "csrf_failed", message, "csrf")


def seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f} s" if value < 120 else str(timedelta(seconds=round(value)))


def when(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S UTC") if value is not None else "-"


def sparkline(counts: list[int], width: int = 120, height: int = 24) -> Markup:
    """An inline SVG line of `counts` (the overview's throughput), scaled to its own maximum."""
    top = max(counts, default=0) or 1
    step = width / max(len(counts) - 1, 1)
    points = " ".join(f"{i * step:.1f},{height - 1 - (n / top) * (height - 2):.1f}"
                      for i, n in enumerate(counts))
    return Markup(f'<svg class="spark" width="{width}" height="{height}" role="img" '
                  f'aria-label="jobs succeeded per minute, at most {top}"><polyline fill="none" '
                  f'stroke="#2e90fa" stroke-width="1.5" points="{points}"/></svg>')


templates.env.filters["seconds"] = seconds
templates.env.filters["sparkline"] = sparkline
templates.env.filters["when"] = when
