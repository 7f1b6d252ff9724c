"""Scheduled jobs: promoted to queued when due, the next due time, and their counts (from the job tallies,
core/store/job_tallies.py: `scheduled` is tallied since migration 0026)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from conveyor.core.lifecycle import QUEUED, SCHEDULED
from conveyor.core.store import job_tallies
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


def count_scheduled_in(session: Session, lane: str, tenant_id: str) -> int:
    """The tenant's scheduled jobs in `lane`, read from the job tallies (an admission check: its cost follows
    the tenants and the deltas not folded yet, not the jobs scheduled)."""
    return job_tallies.count(session, lane, SCHEDULED, tenant_id)


def count_scheduled(session: Session, tenant_id: str | None = None) -> dict[str, int]:
    """Scheduled jobs per lane (apart from the depth: they join their queue once due), read from the job
    tallies; with `tenant_id`, that tenant's only."""
    return {queue: tally.scheduled for queue, tally in job_tallies.tallies(session, tenant_id).items()
            if tally.scheduled}
