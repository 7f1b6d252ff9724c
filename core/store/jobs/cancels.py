"""-> cancelled: a client's cancel of one job, and a purge of a queue's waiting jobs."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import update
from sqlalchemy.orm import Session

from conveyor.core.lifecycle import CANCELLED, QUEUED, RUNNING, SCHEDULED, WAITING_STATUSES
from conveyor.core.store.final_status_effects import record_finished
from conveyor.core.store.jobs.reads import get
from conveyor.core.store.jobs.transitions import lock_in_id_order, transition
from conveyor.core.store.tables import Job


def cancel(session: Session, job_id: str, tenant_id: str, now: datetime) -> Job | None:
    """scheduled|queued|running -> cancelled. Returns the job as it now is (any status), or None if the tenant
    has no such job; the caller tells 'cancelled' from 'already finished' by its status."""
    transition(
        session, job_id, (SCHEDULED, QUEUED, RUNNING), Job.tenant_id == tenant_id,
        status=CANCELLED, error_code="cancelled", error_message="cancelled by the client", finished_at=now,
        updated_at=now,
    )
    return get(session, job_id, tenant_id)


def cancel_queued(session: Session, lanes: list[str], tenant_id: str | None, now: datetime, limit: int,
                  ) -> list[str]:
    """scheduled|queued -> cancelled for up to `limit` jobs of `lanes` (a purge), oldest ids first, of
    `tenant_id` (None: every tenant's), with their effects (webhooks, counts, batch lines) as for any cancel;
    committed. Returns their ids."""
    owned = [Job.tenant_id == tenant_id] if tenant_id is not None else []
    waiting = Job.status.in_(WAITING_STATUSES)
    locked = lock_in_id_order(session, Job.queue.in_(lanes), waiting, *owned, limit=limit)
    statement = (
        update(Job).where(Job.id.in_(locked), waiting)
        .values(status=CANCELLED, error_code="cancelled", error_message="cancelled by a purge of its queue",
                finished_at=now, updated_at=now)
        .returning(Job.id).execution_options(synchronize_session=False)
    )
    ids = list(session.execute(statement).scalars()) if locked else []
    if ids:
        record_finished(session, ids, CANCELLED, now)
    session.commit()
    return ids
