"""API keys, each bound to a tenant: `Authorization: Bearer`, and on the Anthropic routes `x-api-key` too.
With auth off (loopback only) requests are the default tenant.

A key is looked up through the process's AuthCache (core/store/auth_cache.py): a key cached is answered on
the event loop, with no thread-pool hand-off and no query; a key not cached is read in the thread pool, and
cached if active. A revoked key is refused by every process within `auth_cache_s`, and at once where the
store announces revocations (PostgreSQL, core/store/auth_listener.py)."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr

from conveyor.api.deps import Services, ServicesDep
from conveyor.api.errors import ApiError
from conveyor.core.settings import Settings
from conveyor.core.store import keys
from conveyor.core.store.tables import DEFAULT_TENANT

bearer_scheme = HTTPBearer(auto_error=False, description="Authorization: Bearer <API key>")


class SentAPIKeyHeader(APIKeyHeader):
    """The header's value as sent: None only when it is absent (APIKeyHeader reads an empty one as absent,
    which would let a request with an empty `x-api-key` pass on its other header's key)."""

    async def __call__(self, request: Request) -> str | None:
        return request.headers.get(self.model.name)


# Anthropic's SDK sends its key as `x-api-key`; the Anthropic routes take either header.
api_key_scheme = SentAPIKeyHeader(name="x-api-key", scheme_name="APIKeyHeader", auto_error=False,
                                  description="x-api-key: <API key>")


async def current_tenant(
    services: ServicesDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]
) -> str:
    """The caller's tenant. Async, so that with auth off, or a cached key, a request takes no thread-pool
    hand-off for it; a key not cached is looked up in the thread pool on a session of its own, closed at
    once (so a request that then waits, a long poll or a stream, holds no database connection)."""
    if not services.settings.auth_enabled:
        return DEFAULT_TENANT
    if credentials is None or not credentials.credentials:
        raise _unauthorized("Authorization: a Bearer API key is required")
    return await _tenant_of(services, credentials.credentials)


async def anthropic_tenant(
    services: ServicesDep, api_key: Annotated[str | None, Depends(api_key_scheme)],
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
) -> str:
    """The caller's tenant on the Anthropic routes: the key of `x-api-key` (what Anthropic's SDK sends) when
    that header is sent, else of `Authorization: Bearer`; looked up as current_tenant looks it up."""
    if not services.settings.auth_enabled:
        return DEFAULT_TENANT
    key = api_key if api_key is not None else credentials.credentials if credentials is not None else None
    if not key:
        raise _unauthorized("x-api-key: an API key is required (x-api-key, or Authorization: Bearer)")
    try:
        return await _tenant_of(services, key)
    except ApiError as exc:  # the header the key came in is the one to name
        if api_key and exc.status == 401:
            raise _unauthorized("x-api-key: the API key is invalid or revoked") from None
        raise


async def _tenant_of(services: Services, plaintext: str) -> str:
    grant = services.auth_cache.cached_grant(keys.hash_key(plaintext))
    if grant is not None:
        return grant.tenant
    return await run_in_threadpool(tenant_of_key, services, plaintext)


def tenant_of_key(services: Services, plaintext: str) -> str:
    """The key's tenant, through the cache (read from the store when not cached); 401 unless active."""
    with services.session_factory() as session:
        grant = services.auth_cache.grant(session, keys.hash_key(plaintext))
    if grant is None:
        raise _unauthorized("Authorization: the API key is invalid or revoked")
    return grant.tenant


async def admin_caller(
    services: ServicesDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]
) -> None:
    """Lets an admin through: anybody with auth off; with auth on, the admin token or an admin API key
    (`conveyor keys create --admin`). A tenant's key is refused 403; no key, or an unknown or revoked one,
    401. Looked up as current_tenant looks a key up (the cache, else the thread pool)."""
    settings = services.settings
    if not settings.auth_enabled:
        return
    if credentials is None or not credentials.credentials:
        raise _unauthorized("Authorization: a Bearer admin API key (or the admin token) is required")
    if admin_authorized(settings, f"Bearer {credentials.credentials}"):
        return
    grant = services.auth_cache.cached_grant(keys.hash_key(credentials.credentials))
    if grant is None:
        grant = await run_in_threadpool(_grant_of_key, services, credentials.credentials)
    if not grant.admin:
        raise ApiError(403, "admin_required", "Authorization: this route needs an admin API key (`conveyor "
                       "keys create --tenant ops --admin`) or the admin token; a tenant's key is not enough",
                       "Authorization")


def _grant_of_key(services: Services, plaintext: str) -> keys.KeyGrant:
    """The key's grant, through the cache (read from the store when not cached); 401 unless active."""
    with services.session_factory() as session:
        grant = services.auth_cache.grant(session, keys.hash_key(plaintext))
    if grant is None:
        raise _unauthorized("Authorization: the API key is invalid or revoked")
    return grant


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, "unauthorized", message, "Authorization", {"WWW-Authenticate": "Bearer"})


CurrentTenant = Annotated[str, Depends(current_tenant)]
WaitingTenant = CurrentTenant  # it holds no database session while the request waits
AnthropicTenant = Annotated[str, Depends(anthropic_tenant)]  # holds none either
AdminCaller = Depends(admin_caller)  # a route's `dependencies=[AdminCaller]`: it runs before any query


def metrics_authorized(settings: Settings, authorization: str | None) -> bool:
    """May this `Authorization` header read /metrics? With a metrics token set, only `Bearer <token>` may;
    without one, anybody with auth off (the loopback default) and nobody with auth on.

    Tenant API keys are never enough: the metrics are cluster-wide (every tenant's queue depths, outcomes
    and request counts), so one tenant's key must not read them.
    """
    return _token_authorized(settings, settings.metrics_token, authorization)


def admin_authorized(settings: Settings, authorization: str | None) -> bool:
    """May this `Authorization` header call the admin routes? As for /metrics, with the admin token: only
    `Bearer <token>` with one set; without one, anybody with auth off and nobody with auth on. A tenant's
    API key is never enough: the admin routes change what every tenant is served."""
    return _token_authorized(settings, settings.admin_token, authorization)


def _token_authorized(settings: Settings, token: SecretStr | None, authorization: str | None) -> bool:
    if token is None:
        return not settings.auth_enabled
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return False
    # compare_digest on bytes: constant time, and no TypeError on a non-ASCII header value.
    return hmac.compare_digest(given.strip().encode(), token.get_secret_value().encode())
