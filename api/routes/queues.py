"""/v1/queues, per caller: its own queued and running jobs, oldest queued age and quota use per queue, with
the queue's limits and live workers; an admin key (or auth off) sees the totals across tenants."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.security import HTTPAuthorizationCredentials

from api.auth import CurrentTenant, bearer_scheme
from api.deps import Services, ServicesDep, SessionDep
from api.schemas.errors import error_responses
from api.schemas.queues import DeadlineCounts, QueueList, QueuePublic, TenantQueueLimits
from api.submit import model_max_len
from core.clock import utcnow
from core.model_limits import clamp_queue_limits
from core.settings import QueueSettings
from core.store import jobs, keys, tenants, token_usage, workers
from core.store.tenants import TenantLimits

router = APIRouter(prefix="/v1/queues", tags=["queues"])
GOODPUT_WINDOW = timedelta(hours=1)
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]


@router.get("", response_model=QueueList, responses=error_responses(401))
def list_queues(session: SessionDep, services: ServicesDep, tenant: CurrentTenant,
                credentials: Credentials) -> QueueList:
    admin = not services.settings.auth_enabled or (
        credentials is not None and keys.is_admin_key(session, credentials.credentials))
    counts = jobs.queue_counts(session, None if admin else tenant)
    now = utcnow()
    consumers = workers.live_workers_per_queue(session, now=now,
                                               dead_after_s=services.settings.worker_dead_after_s)
    own = tenants.effective_limits(session, tenant, TenantLimits.defaults(services.settings))
    own_limits = TenantQueueLimits(weight=own.weight, max_queued=own.max_queued, max_running=own.max_running)
    deadlines = jobs.deadline_counts(session, now - GOODPUT_WINDOW, None if admin else tenant)
    data = []
    for name, limits in services.settings.queues.items():
        c = counts.get(name, jobs.QueueCounts(0, 0, None))
        age = round((now - c.oldest_queued_at).total_seconds(), 3) if c.oldest_queued_at else None
        data.append(QueuePublic(name=name, queued=c.queued, running=c.running, oldest_queued_age_s=age,
                                workers=consumers.get(name, 0), limits=queue_limits(services, limits),
                                tenant_limits=own_limits,
                                deadlines_last_hour=DeadlineCounts(**deadlines.get(name, {}))))
    return QueueList(data=data, scope="all" if admin else "tenant", tenant=tenant,
                     tokens_per_minute=own.tokens_per_minute,
                     tokens_used_last_minute=token_usage.tokens_used(session, tenant, now))


def queue_limits(services: Services, limits: QueueSettings) -> QueueSettings:
    """A queue's limits as shown: clamped to what the served model can run."""
    return clamp_queue_limits(limits, model_max_len(services))
