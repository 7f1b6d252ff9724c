"""Scheduled jobs: promoted to queued when due, the next due time, and their counts."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import func, literal_column, select, update
from sqlalchemy.orm import Session

from conveyor.core.lifecycle import QUEUED, SCHEDULED
from conveyor.core.store.jobs.transitions import status_is, unlocked
from conveyor.core.store.tables import Job

PROMOTE_BATCH = 500  # scheduled jobs made queued per statement (promote_due)


def promote_due(session: Session, now: datetime, batch: int = PROMOTE_BATCH) -> list[tuple[str, str]]:
    """scheduled -> queued (undispatched) for the jobs due by `now`, earliest due first, `batch` at a time,
    each batch committed; returns their (id, queue) in due order, to publish in that order. Rows another
    transaction holds are skipped (`unlocked`): two schedulers never promote one job twice, and neither
    waits on the other. A process that dies after a commit leaves its jobs queued and undispatched: the
    reconciler publishes them (dispatch_grace_s)."""
    due = [status_is(SCHEDULED), Job.run_at <= now]
    promoted: list[tuple[str, str]] = []
    while True:
        ids = list(session.execute(unlocked(*due).order_by(Job.run_at, Job.id).limit(batch)).scalars())
        rows: list[tuple[str, str, datetime]] = []
        if ids:
            statement = (update(Job).where(Job.id.in_(ids), *due)
                         .values(status=QUEUED, dispatched_at=None, updated_at=now)
                         .returning(Job.id, Job.queue, Job.run_at)
                         .execution_options(synchronize_session=False))
            rows = [(job_id, queue, run_at) for job_id, queue, run_at in session.execute(statement)]
        session.commit()
        promoted += [(job_id, queue) for job_id, queue, _ in sorted(rows, key=lambda row: (row[2], row[0]))]
        if len(ids) < batch:
            return promoted


def next_due(session: Session) -> datetime | None:
    """When the earliest scheduled job is due (ix_jobs_scheduled's first row); None: none is scheduled."""
    query = select(Job.run_at).where(status_is(SCHEDULED)).order_by(Job.run_at).limit(1)
    return session.execute(query).scalar_one_or_none()


def count_scheduled_in(session: Session, lane: str, tenant_id: str, *, up_to: int) -> int:
    """The tenant's scheduled jobs in `lane`, counted up to `up_to` (an admission check: bounded cost)."""
    rows = select(literal_column("1")).where(status_is(SCHEDULED), Job.queue == lane,
                                             Job.tenant_id == tenant_id).limit(up_to)
    return int(session.execute(select(func.count()).select_from(rows.subquery())).scalar_one())


def count_scheduled(session: Session, tenant_id: str | None = None) -> dict[str, int]:
    """Scheduled jobs per lane (not tallied: they join their queue's depth once due); with `tenant_id`,
    that tenant's only."""
    query = select(Job.queue, func.count()).where(status_is(SCHEDULED)).group_by(Job.queue)
    if tenant_id is not None:
        query = query.where(Job.tenant_id == tenant_id)
    return {queue: int(n) for queue, n in session.execute(query)}
