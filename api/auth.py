"""Bearer API keys, each bound to a tenant. With auth off (loopback only) requests are the default tenant."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.deps import ServicesDep, SessionDep
from api.errors import ApiError
from core.settings import Settings
from core.store import keys
from core.store.tables import DEFAULT_TENANT

bearer_scheme = HTTPBearer(auto_error=False, description="Authorization: Bearer <API key>")


def current_tenant(
    services: ServicesDep,
    session: SessionDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
) -> str:
    if not services.settings.auth_enabled:
        return DEFAULT_TENANT
    if credentials is None or not credentials.credentials:
        raise _unauthorized("Authorization: a Bearer API key is required")
    tenant = keys.tenant_for_key(session, credentials.credentials)
    if tenant is None:
        raise _unauthorized("Authorization: the API key is invalid or revoked")
    return tenant


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, "unauthorized", message, "Authorization", {"WWW-Authenticate": "Bearer"})


CurrentTenant = Annotated[str, Depends(current_tenant)]


def tenant_then_release(
    services: ServicesDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]
) -> str:
    """The caller's tenant, its session closed at once: for requests that then wait (long polls, event
    streams, synchronous completions) without holding a database connection."""
    with services.session_factory() as session:
        return current_tenant(services, session, credentials)


WaitingTenant = Annotated[str, Depends(tenant_then_release)]


def metrics_authorized(settings: Settings, authorization: str | None) -> bool:
    """May this `Authorization` header read /metrics? With a metrics token set, only `Bearer <token>` may;
    without one, anybody with auth off (the loopback default) and nobody with auth on.

    Tenant API keys are never enough: the metrics are cluster-wide (every tenant's queue depths, outcomes
    and request counts), so one tenant's key must not read them.
    """
    token = settings.metrics_token
    if token is None:
        return not settings.auth_enabled
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return False
    # compare_digest on bytes: constant time, and no TypeError on a non-ASCII header value.
    return hmac.compare_digest(given.strip().encode(), token.get_secret_value().encode())
