"""/v1/queues: depth, running jobs, limits, the oldest queued job's age and the live workers, per queue."""

from __future__ import annotations

from fastapi import APIRouter

from api.auth import CurrentTenant
from api.deps import ServicesDep, SessionDep
from api.schemas.errors import error_responses
from api.schemas.queues import QueueList, QueuePublic
from core.clock import utcnow
from core.store import jobs, workers

router = APIRouter(prefix="/v1/queues", tags=["queues"])


@router.get("", response_model=QueueList, responses=error_responses(401))
def list_queues(session: SessionDep, services: ServicesDep, _tenant: CurrentTenant) -> QueueList:
    counts = jobs.queue_counts(session)
    now = utcnow()
    consumers = workers.live_workers_per_queue(session, now=now,
                                               dead_after_s=services.settings.worker_dead_after_s)
    data = []
    for name, limits in services.settings.queues.items():
        c = counts.get(name, jobs.QueueCounts(0, 0, None))
        age = round((now - c.oldest_queued_at).total_seconds(), 3) if c.oldest_queued_at else None
        data.append(QueuePublic(name=name, queued=c.queued, running=c.running, oldest_queued_age_s=age,
                                workers=consumers.get(name, 0), limits=limits))
    return QueueList(data=data)
