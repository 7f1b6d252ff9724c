"""Each API process's cache of what nearly every request reads from the store: an API key's grant (its
tenant, whether it is an admin key) and a tenant's limits. A cached key is answered on the event loop, with
no thread-pool hand-off and no query (api/auth.py); a cached tenant's limits with no query per submit.

How stale an answer may be is bounded twice:
- by time: an entry lives `auth_cache_s` from the moment it was read (core/expiring_map.py), whatever
  else happens; 0 turns the cache off;
- by notices: a revocation or a limit change is announced with its commit (core/store/auth_notices.py), and
  the process's listener (core/store/auth_listener.py) calls `forget` as it hears it. An entry forgotten is
  never stored again by a lookup that read the store before the change (the map's generation).

Only active keys are cached. An unknown or revoked key is read from the store every time: caching refusals
would let someone spraying made-up keys fill the cache, and a key created a moment ago must work at once.
Both maps are bounded (MAX_KEYS, MAX_TENANTS); past that, the entries stored longest ago go first.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sqlalchemy.orm import Session

from conveyor.core.expiring_map import ExpiringMap
from conveyor.core.settings import Settings
from conveyor.core.store import keys, tenants
from conveyor.core.store.auth_notices import AuthNotice
from conveyor.core.store.keys import KeyGrant
from conveyor.core.store.tenants import TenantLimits

MAX_KEYS = 10_000  # about 3 MB of grants; more keys in use than this only means more reads
MAX_TENANTS = 10_000


class AuthCache:
    def __init__(self, ttl_s: float, defaults: TenantLimits, *, clock: Callable[[], float] = time.monotonic,
                 max_keys: int = MAX_KEYS, max_tenants: int = MAX_TENANTS) -> None:
        """`defaults`: the limits of a tenant without overrides (TenantLimits.defaults of the settings)."""
        self.enabled = ttl_s > 0
        self._defaults = defaults
        self._grants: ExpiringMap[str, KeyGrant] = ExpiringMap(ttl_s, max_keys, clock)  # by key hash
        self._limits: ExpiringMap[str, TenantLimits] = ExpiringMap(ttl_s, max_tenants, clock)  # by tenant

    @classmethod
    def for_settings(cls, settings: Settings) -> AuthCache:
        return cls(settings.auth_cache_s, TenantLimits.defaults(settings))

    def cached_grant(self, key_hash: str) -> KeyGrant | None:
        """The grant of a cached active key; None when not cached (it may still be active). No I/O."""
        return self._grants.get(key_hash)

    def grant(self, session: Session, key_hash: str) -> KeyGrant | None:
        """The grant of the active key of this hash (keys.hash_key), from the cache or else the store; None
        for an unknown or revoked key."""
        cached = self._grants.get(key_hash)
        if cached is not None:
            return cached
        ticket = self._grants.ticket()
        found = keys.grant_of_hash(session, key_hash)
        if found is not None:
            self._grants.put(key_hash, found, ticket)
        return found

    def limits(self, session: Session, tenant_id: str) -> TenantLimits:
        """The tenant's limits in effect (its overrides over the defaults), from the cache or else the
        store."""
        cached = self._limits.get(tenant_id)
        if cached is not None:
            return cached
        ticket = self._limits.ticket()
        found = tenants.effective_limits(session, tenant_id, self._defaults)
        self._limits.put(tenant_id, found, ticket)
        return found

    def forget(self, notice: AuthNotice | None) -> None:
        """Drops what the notice names; None (a notice not understood, or notices missed): everything."""
        if notice is None:
            self._grants.clear()
            self._limits.clear()
        elif notice.kind == "key":
            self._grants.drop(notice.subject)
        else:
            self._limits.drop(notice.subject)
