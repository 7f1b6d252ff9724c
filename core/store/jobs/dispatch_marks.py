"""The store's side of dispatch (core/seams/dispatch.py): which queued jobs were handed to the broker,
and which must be again."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import bindparam, select, update
from sqlalchemy.orm import Session

from conveyor.core.lifecycle import QUEUED
from conveyor.core.store.jobs.outcomes import _JOBS
from conveyor.core.store.jobs.transitions import status_is
from conveyor.core.store.tables import Job


def undispatched(session: Session, older_than: datetime) -> list[tuple[str, str]]:
    """(id, queue) of queued jobs never handed to the broker, created before `older_than`."""
    query = (
        select(Job.id, Job.queue)
        .where(status_is(QUEUED), Job.dispatched_at.is_(None), Job.created_at < older_than)
        .order_by(Job.created_at)
    )
    return [(job_id, queue) for job_id, queue in session.execute(query)]


def queued(session: Session) -> list[tuple[str, str]]:
    """(id, queue) of every queued job, oldest first (an embedded start reloads its in-process queues)."""
    query = select(Job.id, Job.queue).where(Job.status == QUEUED).order_by(Job.created_at)
    return [(job_id, queue) for job_id, queue in session.execute(query)]


def dispatched_but_queued(session: Session, queue: str, dispatched_before: datetime, limit: int,
                          ) -> list[tuple[str, str]]:
    """(id, queue) of the queue's jobs still queued though dispatched before `dispatched_before`, the
    earliest dispatched first, then the oldest (ix_jobs_dispatched_queued's order: the read stops at
    `limit`): candidates for a lost broker message."""
    query = (
        select(Job.id, Job.queue)
        .where(status_is(QUEUED), Job.queue == queue, Job.dispatched_at.is_not(None),
               Job.dispatched_at < dispatched_before)
        .order_by(Job.dispatched_at, Job.created_at, Job.id)
        .limit(limit)
    )
    return [(job_id, name) for job_id, name in session.execute(query)]


def mark_dispatched(session: Session, job_ids: list[str], now: datetime) -> None:
    if not job_ids:
        return
    queued = list(session.execute(_LOCK_QUEUED, {"b_ids": job_ids}).scalars())
    session.execute(_MARK_DISPATCHED, {"b_ids": queued, "b_now": now})
    session.commit()


# mark_dispatched's statements, built once (it runs for every group a relay publishes): the rows locked in
# id order first (lock_in_id_order's rule), then marked.
_LOCK_QUEUED = (select(Job.id).where(Job.id.in_(bindparam("b_ids", expanding=True)), Job.status == QUEUED)
                .order_by(Job.id).with_for_update())


_MARK_DISPATCHED = update(_JOBS).where(_JOBS.c.id.in_(bindparam("b_ids", expanding=True)),
                                       _JOBS.c.status == QUEUED).values(
    dispatched_at=bindparam("b_now", type_=_JOBS.c.dispatched_at.type))
