"""Who is looking at the console, and the two cookies that keep it safe.

- With auth off (the loopback default) the console opens without signing in, as the API does, and shows
  every tenant's jobs.
- With auth on, an API key signs in once: the session cookie holds the key's id, an expiry and an HMAC of
  both keyed by the key's stored hash, so it proves the key was shown without holding it, and a revoked key
  ends its sessions at once (each request looks the key up). An admin key sees every tenant; a tenant's key
  only its own tenant's jobs.
- Every action is a POST carrying the CSRF token, which must equal the `SameSite=Strict` CSRF cookie (a
  double submit): another site can neither read the cookie nor make the browser send it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

from fastapi import Request, Response
from sqlalchemy import select
from sqlalchemy.orm import Session

from conveyor.core.store import keys
from conveyor.core.store.tables import ApiKey

SESSION_COOKIE, CSRF_COOKIE = "conveyor_console", "conveyor_console_csrf"
SESSION_S = 12 * 3600  # a sign-in lasts this long


@dataclass(frozen=True)
class Viewer:
    """`tenant`: whose jobs the viewer sees; None: every tenant's (an admin key, or auth off)."""

    tenant: str | None
    label: str  # shown in the page header

    def may_see(self, tenant_id: str) -> bool:
        return self.tenant is None or self.tenant == tenant_id


EVERYONE = Viewer(None, "auth off: every tenant")


def signed_session(key: ApiKey, now_s: float) -> str:
    expires = int(now_s) + SESSION_S
    return f"{key.id}.{expires}.{_mac(key, expires)}"


def key_for_plaintext(session: Session, plaintext: str) -> ApiKey | None:
    """The active key shown at sign-in, or None."""
    query = select(ApiKey).where(ApiKey.key_hash == keys.hash_key(plaintext), ApiKey.revoked_at.is_(None))
    return session.execute(query).scalar_one_or_none()


def viewer_of_cookie(session: Session, cookie: str | None, now_s: float) -> Viewer | None:
    """The signed-in viewer, or None (no cookie, expired, forged, or its key revoked since)."""
    key_id, _, rest = (cookie or "").partition(".")
    expires, _, mac = rest.partition(".")
    if not key_id or not expires.isdigit() or int(expires) < now_s:
        return None
    key = session.get(ApiKey, key_id)
    if key is None or key.revoked_at is not None or not hmac.compare_digest(mac, _mac(key, int(expires))):
        return None
    if key.is_admin:
        return Viewer(None, f"admin key {key.prefix}… ({key.tenant_id}): every tenant")
    return Viewer(key.tenant_id, f"tenant {key.tenant_id} (key {key.prefix}…)")


def _mac(key: ApiKey, expires: int) -> str:
    return hmac.new(key.key_hash.encode(), f"console:{key.id}:{expires}".encode(), hashlib.sha256).hexdigest()


def csrf_token(request: Request) -> str:
    """The CSRF cookie's token, or a new one (set on the response by `keep_csrf`)."""
    return request.cookies.get(CSRF_COOKIE) or secrets.token_urlsafe(32)


def keep_csrf(request: Request, response: Response, token: str) -> None:
    set_cookie(request, response, CSRF_COOKIE, token, SESSION_S)


def csrf_ok(request: Request, submitted: str | None) -> bool:
    cookie = request.cookies.get(CSRF_COOKIE)
    return bool(cookie and submitted) and hmac.compare_digest(str(cookie), str(submitted))


def set_cookie(request: Request, response: Response, name: str, value: str, max_age: int) -> None:
    response.set_cookie(name, value, max_age=max_age, path="/console", httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")


def now_s() -> float:
    return time.time()
