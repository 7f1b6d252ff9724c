"""Each tenant's limits: the settings' defaults, overridden per tenant by the nullable columns of `tenants`
(`conveyor tenants set`). NULL in a column means the default applies; a default of None means no limit of
that kind (the queue's own limits still hold).

And each tenant's prefix-cache partition: every job is submitted to the engine with its tenant's cache salt
(`cache_salt`), so a cache hit (its `cached_tokens`, its shorter time to first token) never tells one tenant
what another asked. By default the salt is the tenant's own; tenants that trust each other (say, to share an
operator's long system prompt) are given the same `cache_namespace`, and share cached prefixes only then.

The API reads a tenant's limits through its per-process cache (core/store/auth_cache.py); a change is
announced with its commit (core/store/auth_notices.py), so that every API process drops its copy at once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Row, bindparam, select, update
from sqlalchemy.orm import Session

from conveyor.core.lifecycle import QUEUED
from conveyor.core.protocol.request_fields import MAX_PRIORITY
from conveyor.core.protocol.service_tiers import PriorityRange
from conveyor.core.settings import Settings
from conveyor.core.store import auth_notices, jobs
from conveyor.core.store.keys import ensure_tenant
from conveyor.core.store.tables import Job, Tenant

LIMIT_FIELDS = ("weight", "max_queued", "max_running", "tokens_per_minute", "retention_days", "min_priority",
                "max_priority")
PRIORITY_FIELDS = ("min_priority", "max_priority")
OVERRIDE_FIELDS = (*LIMIT_FIELDS, "cache_namespace")  # what `set_overrides` sets; NULL: the default
_LIMITS_OF_TENANT = select(*(getattr(Tenant, name) for name in LIMIT_FIELDS)).where(
    Tenant.id == bindparam("tenant_id"))


@dataclass(frozen=True)
class TenantLimits:
    """What one tenant may do, per queue (weight, max_queued, max_running) and overall (the rest)."""

    weight: float = 1.0  # its share of a queue's slots against other tenants' weights
    max_queued: int | None = None  # its queued jobs in one queue
    max_running: int | None = None  # its running jobs in one queue, across the fleet
    tokens_per_minute: int | None = None  # prompt + output tokens of the jobs it submitted in the last minute
    retention_days: int | None = None  # its finished data is purged after this long
    min_priority: int | None = None  # the most urgent priority its jobs may ask for (lower is first)
    max_priority: int | None = None  # the least urgent

    @classmethod
    def defaults(cls, settings: Settings) -> TenantLimits:
        return cls(weight=settings.tenant_weight, max_queued=settings.tenant_max_queued,
                   max_running=settings.tenant_max_running,
                   tokens_per_minute=settings.tenant_tokens_per_minute,
                   retention_days=settings.retention_days, min_priority=settings.tenant_min_priority,
                   max_priority=settings.tenant_max_priority)

    @property
    def priorities(self) -> PriorityRange:
        return PriorityRange(self.min_priority, self.max_priority)

    def with_overrides(self, tenant: Tenant | Row[Any] | None) -> TenantLimits:
        """These defaults with the tenant's non-NULL columns in their place (a Tenant, or a row of its
        LIMIT_FIELDS)."""
        if tenant is None:
            return self
        given = {name: getattr(tenant, name) for name in LIMIT_FIELDS if getattr(tenant, name) is not None}
        return TenantLimits(**{**asdict(self), **given})


def effective_limits(session: Session, tenant_id: str, defaults: TenantLimits) -> TenantLimits:
    """Read on every submit: the limit columns only, no ORM object (a third of the cost of session.get)."""
    row = session.execute(_LIMITS_OF_TENANT, {"tenant_id": tenant_id}).first()
    return defaults.with_overrides(row)


def overrides_of(tenant: Tenant) -> dict[str, Any]:
    """The tenant's own columns, None where the default applies."""
    return {name: getattr(tenant, name) for name in OVERRIDE_FIELDS}


def cache_salt(tenant_id: str, cache_namespace: str | None) -> str:
    """The engine's prefix-cache salt for a tenant's jobs: its namespace's when it has one, else its own.

    NOTE: the two prefixes keep the spaces apart: a tenant whose id equals some namespace's name still
    shares nothing with the tenants of that namespace.
    """
    return f"tenant:{tenant_id}" if cache_namespace is None else f"namespace:{cache_namespace}"


def cache_salts(session: Session, tenant_ids: Iterable[str]) -> dict[str, str]:
    """`cache_salt` of each of these tenants, read in one query (a tenant without a row gets its own)."""
    ids = set(tenant_ids)
    if not ids:
        return {}
    rows = session.execute(select(Tenant.id, Tenant.cache_namespace).where(Tenant.id.in_(ids))).all()
    namespaces: dict[str, str | None] = {tenant_id: namespace for tenant_id, namespace in rows}
    return {tenant_id: cache_salt(tenant_id, namespaces.get(tenant_id)) for tenant_id in ids}


def set_overrides(session: Session, tenant_id: str, changes: dict[str, Any], now: datetime) -> Tenant:
    """Sets (or, with None, clears) the named overrides, creating the tenant if new, and commits. Raises
    ValueError naming the field for an unknown field or a value out of range."""
    for name, value in changes.items():
        _check_override(name, value)
    tenant = ensure_tenant(session, tenant_id, now)
    for name, value in changes.items():
        setattr(tenant, name, value)
    if tenant.min_priority is not None and tenant.max_priority is not None and (
            tenant.min_priority > tenant.max_priority):
        session.rollback()
        raise ValueError(f"min_priority: {tenant.min_priority} is above max_priority {tenant.max_priority}")
    _redispatch_queued(session, tenant_id)
    auth_notices.send(session, auth_notices.limits_changed(tenant_id))
    session.commit()
    return tenant


def list_tenants(session: Session) -> list[Tenant]:
    return list(session.execute(select(Tenant).order_by(Tenant.id)).scalars())


def _check_override(name: str, value: Any) -> None:
    if name not in OVERRIDE_FIELDS:
        raise ValueError(f"{name}: not a tenant limit; known: {', '.join(OVERRIDE_FIELDS)}")
    if value is None:
        return
    if name == "cache_namespace":
        if not isinstance(value, str) or not 1 <= len(value) <= 64 or value != value.strip():
            raise ValueError(f"cache_namespace: must be 1 to 64 characters, no surrounding spaces, "
                             f"got {value!r}")
        return
    if name in PRIORITY_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int) or abs(value) > MAX_PRIORITY:
            raise ValueError(f"{name}: must be an integer of at most {MAX_PRIORITY} either side of 0, "
                             f"got {value!r}")
        return
    if name == "weight":
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1e6:
            raise ValueError(f"weight: must be a number in (0, 1000000], got {value!r}")
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 2**31 - 1:
        raise ValueError(f"{name}: must be an integer of at least 1, got {value!r}")


def _redispatch_queued(session: Session, tenant_id: str) -> None:
    """Marks the tenant's queued jobs undispatched, so a reconciler publishes them again within
    dispatch_grace_s: a raised max_running lets some of them start, and their earlier messages may have been
    consumed (and dropped) while the tenant was at its cap."""
    queued = jobs.lock_in_id_order(session, Job.tenant_id == tenant_id, Job.status == QUEUED)
    statement = update(Job).where(Job.id.in_(queued), Job.status == QUEUED).values(dispatched_at=None)
    session.execute(statement.execution_options(synchronize_session=False))
