"""/v1/queues, per caller: its own queued and running jobs, oldest queued age, goodput (jobs with a deadline
that ended in the last hour: on time, late, missed; in all and per service tier) and quota use per queue of
each served model, with the queue's limits (as the model can run them) and live workers; an admin key (or
auth off) sees the totals across tenants, or, with `?tenant=T`, the listing as tenant T sees it."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Depends, Query
from fastapi.security import HTTPAuthorizationCredentials

from conveyor.api import queue_purge
from conveyor.api.auth import CurrentTenant, bearer_scheme
from conveyor.api.deps import ServicesDep, SessionDep
from conveyor.api.errors import ApiError
from conveyor.api.schemas.errors import error_responses
from conveyor.api.schemas.queues import DeadlineCounts, Purged, QueueList, QueuePublic, TenantQueueLimits
from conveyor.core.clock import utcnow
from conveyor.core.protocol.model_limits import clamp_queue_limits
from conveyor.core.protocol.request_rules import text_problem
from conveyor.core.settings import UnknownModelError
from conveyor.core.store import job_tallies, jobs, keys, tenants, token_usage, workers
from conveyor.core.store.tenants import TenantLimits

router = APIRouter(prefix="/v1/queues", tags=["queues"])
GOODPUT_WINDOW = timedelta(hours=1)
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]


TenantQuery = Annotated[str | None, Query(
    alias="tenant", max_length=64,
    description="an admin key (or auth off) only: the listing for this tenant, as it would see it (its "
    "counts, goodput, limits and token use); another key may name only its own tenant (403 otherwise)")]


@router.get("", response_model=QueueList, responses=error_responses(401, 403, 422))
def list_queues(session: SessionDep, services: ServicesDep, caller: CurrentTenant,
                credentials: Credentials, tenant_: TenantQuery = None) -> QueueList:
    admin = not services.settings.auth_enabled or (
        credentials is not None and keys.is_admin_key(session, credentials.credentials))
    tenant = listed_tenant(caller, admin, tenant_)
    counted = None if admin and tenant_ is None else tenant  # None: every tenant's jobs
    now = utcnow()
    counts = job_tallies.queue_counts(session, now, counted, may_fold=True)
    consumers = workers.live_workers_per_queue(session, now=now,
                                               dead_after_s=services.settings.worker_dead_after_s)
    own = tenants.effective_limits(session, tenant, TenantLimits.defaults(services.settings))
    own_limits = TenantQueueLimits(weight=own.weight, max_queued=own.max_queued, max_running=own.max_running)
    deadlines = jobs.deadline_counts(session, now - GOODPUT_WINDOW, counted)
    data = []
    for model in services.models:
        for name, limits in model.settings.queues.items():
            lane = model.lane(name)
            c = counts.get(lane, job_tallies.QueueCounts(0, 0, None))
            age = round((now - c.oldest_queued_at).total_seconds(), 3) if c.oldest_queued_at else None
            by_tier = {tier: DeadlineCounts(**n) for tier, n in sorted(deadlines.get(lane, {}).items())}
            data.append(QueuePublic(
                name=name, model=model.id, queued=c.queued, running=c.running,
                scheduled=c.scheduled, oldest_queued_age_s=age,
                workers=consumers.get(lane, 0), limits=clamp_queue_limits(limits, model.max_model_len()),
                tenant_limits=own_limits, deadlines_last_hour=total(by_tier.values()),
                deadlines_last_hour_by_tier=by_tier))
    return QueueList(data=data, scope="all" if counted is None else "tenant", tenant=tenant,
                     tokens_per_minute=own.tokens_per_minute,
                     tokens_used_last_minute=token_usage.tokens_used(session, tenant, now))


ModelQuery = Annotated[str | None, Query(
    alias="model", max_length=128, description="purge this served model's queue only; unset: every model's "
    "queue of that name")]


@router.post("/{name}/purge", response_model=Purged, responses=error_responses(401, 404, 422))
def purge_queue(name: str, session: SessionDep, services: ServicesDep, caller: CurrentTenant,
                credentials: Credentials, model: ModelQuery = None) -> Purged:
    """Cancels every queued and scheduled job of the caller in the queue `name` (of every served model, or
    of `?model=`); with an admin key (or auth off), every tenant's. Running jobs are left alone (cancel them
    one by one). In chunks (api/queue_purge.py), each committed with its effects: a cancelled webhook per
    job, as if cancelled one by one."""
    admin = not services.settings.auth_enabled or (
        credentials is not None and keys.is_admin_key(session, credentials.credentials))
    try:
        models = [services.models.get(model, caller)] if model is not None else list(services.models)
    except UnknownModelError as exc:
        raise ApiError(404, "model_not_found", str(exc), "model") from None
    lanes = [m.lane(name) for m in models if name in m.settings.queues]
    if not lanes:
        raise ApiError(404, "unknown_queue", f"name: no served model has a queue {name!r}", "name")
    tenant = None if admin else caller
    return Purged(queue=name, cancelled=queue_purge.purge(session, services, lanes, tenant), tenant=tenant)


def listed_tenant(caller: str, admin: bool, asked: str | None) -> str:
    """The tenant the listing is for: `asked` (?tenant=), which only an admin may set to another tenant."""
    if asked is None or asked == caller:
        return caller
    problem = text_problem(asked)
    if problem is not None:
        raise ApiError(422, "invalid_request", f"tenant: {problem}", "tenant")
    if not admin:
        raise ApiError(403, "tenant_not_permitted",
                       "tenant: only an admin key may list another tenant's queues; omit it or name your own",
                       "tenant")
    return asked


def total(counts: Iterable[DeadlineCounts]) -> DeadlineCounts:
    """The outcomes of every tier together."""
    found = list(counts)
    return DeadlineCounts(on_time=sum(c.on_time for c in found), late=sum(c.late for c in found),
                          missed=sum(c.missed for c in found))
