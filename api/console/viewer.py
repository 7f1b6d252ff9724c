"""Who is looking at the console, and what keeps its forms safe.

- A browser's session lives in the store (core/store/console_sessions.py); its cookie holds the session's
  random secret (HttpOnly, SameSite=Strict). Each request looks the session up, so signing out ends it at
  once, on every API process.
- With auth on, an API key signs in, which opens a session of that key; each request looks the key up
  too, so a revoked key ends its sessions at once. An admin key sees every tenant; a tenant's key only its
  own tenant's jobs.
- With auth off (the loopback default) the console opens without signing in, as the API does, and shows
  every tenant's jobs; the first page a browser loads opens its session (nobody's).
- Every action is a POST carrying the session's CSRF token: an HMAC of the session id keyed by the session's
  secret. Another page can neither read it nor make it: a cookie it plants (a page on another port of the
  same host is the same site to the browser) names no session in the store.
- The sign-in form comes before any session: its token is a double submit (a cookie, and the same value in
  the form). It guards a sign-in alone, beside the Origin check every POST gets (api/host_check.py).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import datetime

from fastapi import Request, Response
from sqlalchemy import select
from sqlalchemy.orm import Session

from conveyor.core.store import console_sessions, keys
from conveyor.core.store.console_sessions import SESSION_S
from conveyor.core.store.tables import ApiKey

SESSION_COOKIE, SIGN_IN_COOKIE = "conveyor_console", "conveyor_console_csrf"
# What console_sessions.open_session hands out (secrets.token_urlsafe(32)): any other cookie is no session,
# judged before anything parses or looks it up.
SECRET_SHAPE = re.compile(r"[A-Za-z0-9_-]{43}")
AUTH_OFF_LABEL = "auth off: every tenant"


@dataclass(frozen=True)
class Viewer:
    """`tenant`: whose jobs the viewer sees; None: every tenant's (an admin key, or auth off)."""

    tenant: str | None
    label: str  # shown in the page header
    csrf: str | None = None  # the token its forms carry; None: no session, so every action is refused
    signed_in: bool = False  # a key's session (auth on): the header offers to sign out
    opened: str | None = None  # the secret of a session this request opened (auth off), set as the cookie

    def may_see(self, tenant_id: str) -> bool:
        return self.tenant is None or self.tenant == tenant_id


def session_secret(request: Request) -> str | None:
    """The session cookie's secret, when it has the shape of one."""
    cookie = request.cookies.get(SESSION_COOKIE)
    return cookie if cookie is not None and SECRET_SHAPE.fullmatch(cookie) else None


def signed_in_viewer(session: Session, secret: str | None, now: datetime) -> Viewer | None:
    """The viewer of a key's live session, or None (no session, ended, expired, or its key revoked)."""
    found = console_sessions.find(session, secret, now) if secret is not None else None
    key = session.get(ApiKey, found.key_id) if found is not None and found.key_id is not None else None
    if secret is None or key is None or key.revoked_at is not None:
        return None
    if key.is_admin:
        return Viewer(None, f"admin key {key.prefix}… ({key.tenant_id}): every tenant", csrf_of(secret),
                      signed_in=True)
    return Viewer(key.tenant_id, f"tenant {key.tenant_id} (key {key.prefix}…)", csrf_of(secret),
                  signed_in=True)


def anonymous_viewer(session: Session, secret: str | None, now: datetime, may_open: bool) -> Viewer:
    """Auth off: the browser's session, or a new one when `may_open` (a page, not an action)."""
    if secret is not None and console_sessions.find(session, secret, now) is not None:
        return Viewer(None, AUTH_OFF_LABEL, csrf_of(secret))
    if not may_open:
        return Viewer(None, AUTH_OFF_LABEL)
    opened = console_sessions.open_session(session, None, now)
    return Viewer(None, AUTH_OFF_LABEL, csrf_of(opened), opened=opened)


def key_for_plaintext(session: Session, plaintext: str) -> ApiKey | None:
    """The active key shown at sign-in, or None."""
    query = select(ApiKey).where(ApiKey.key_hash == keys.hash_key(plaintext), ApiKey.revoked_at.is_(None))
    return session.execute(query).scalar_one_or_none()


def csrf_of(secret: str) -> str:
    """A session's CSRF token: an HMAC of its id, keyed by its secret."""
    message = f"console csrf:{console_sessions.session_id(secret)}".encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def csrf_ok(expected: str | None, submitted: str | None) -> bool:
    """Whether the form's token is the expected one. A token is ASCII: anything else is a mismatch (and
    hmac.compare_digest, given non-ASCII text, raises)."""
    if not expected or not submitted or not submitted.isascii():
        return False
    return hmac.compare_digest(expected.encode(), submitted.encode())


def sign_in_token(request: Request) -> str:
    """The sign-in form's token: its cookie's, or a new one (set by `keep_sign_in_token`)."""
    cookie = request.cookies.get(SIGN_IN_COOKIE)
    return cookie if cookie is not None and SECRET_SHAPE.fullmatch(cookie) else secrets.token_urlsafe(32)


def keep_session(request: Request, response: Response, secret: str) -> None:
    set_cookie(request, response, SESSION_COOKIE, secret, SESSION_S)


def keep_sign_in_token(request: Request, response: Response, token: str) -> None:
    set_cookie(request, response, SIGN_IN_COOKIE, token, SESSION_S)


def sign_in_token_ok(request: Request, submitted: str | None) -> bool:
    cookie = request.cookies.get(SIGN_IN_COOKIE)
    return cookie is not None and SECRET_SHAPE.fullmatch(cookie) is not None and csrf_ok(cookie, submitted)


def set_cookie(request: Request, response: Response, name: str, value: str, max_age: int) -> None:
    response.set_cookie(name, value, max_age=max_age, path="/console", httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")
