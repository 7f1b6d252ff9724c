"""What the reconciler mends: jobs of dead workers failed or requeued, claims a live worker never got,
jobs past their ttl expired, and bare-queue jobs of the release before lanes adopted."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import and_, func, select, update
from sqlalchemy.orm import Session

from conveyor.core.lanes import lane_of, queue_of
from conveyor.core.lifecycle import EXPIRED, FAILED, QUEUED, RUNNING
from conveyor.core.retry_policy import WORKER_LOST
from conveyor.core.store.final_status_effects import record_finished
from conveyor.core.store.jobs.transitions import expired_values, status_is, transition, unlocked
from conveyor.core.store.tables import Job, JobTallyDelta
from conveyor.core.store.token_usage import DEFAULT_MAX_TOKENS

EXPIRE_BATCH = 500  # queued jobs past their ttl expired per statement (expire_overdue)


def fail_lost(session: Session, dead_worker_ids: list[str], now: datetime, max_attempts: int) -> list[str]:
    """running -> failed (`worker_lost`) for jobs held by dead workers that have used their retries: their
    own `max_retries`, else max_attempts - 1 (each requeue after a worker died counts one): a job that kills
    its worker every time must not take the fleet down one worker after another. Run before
    `requeue_orphans`, which requeues the rest. Commits; returns the ids."""
    if not dead_worker_ids:
        return []
    allowed = func.coalesce(Job.max_retries, max_attempts - 1)
    spent = [Job.status == RUNNING, Job.worker_id.in_(dead_worker_ids), Job.retries >= allowed]
    message = (f"the worker running this job died, and the job has used its retries (its max_retries, or "
               f"max_attempts ({max_attempts}) runs)")
    statement = (
        update(Job)
        .where(Job.id.in_(unlocked(*spent)), *spent)
        .values(status=FAILED, error_code=WORKER_LOST, error_message=message, finished_at=now, updated_at=now)
        .returning(Job.id)
        .execution_options(synchronize_session=False)
    )
    ids = list(session.execute(statement).scalars())
    if ids:
        record_finished(session, ids, FAILED, now)
    session.commit()
    return ids


def requeue_orphans(session: Session, dead_worker_ids: list[str], now: datetime) -> list[tuple[str, str]]:
    """running -> queued for jobs held by dead workers; they are undispatched again, to be re-published."""
    if not dead_worker_ids:
        return []
    orphaned = [Job.status == RUNNING, Job.worker_id.in_(dead_worker_ids)]
    statement = (
        update(Job)
        .where(Job.id.in_(unlocked(*orphaned)), *orphaned)
        .values(status=QUEUED, worker_id=None, dispatched_at=None, first_token_at=None, updated_at=now,
                retries=Job.retries + 1)
        .returning(Job.id, Job.queue)
        .execution_options(synchronize_session=False)
    )
    rows = [(job_id, queue) for job_id, queue in session.execute(statement)]
    session.commit()
    return rows


def adopt_bare_queued(session: Session, default_model: str, queue_names: list[str], now: datetime,
                      ) -> list[tuple[str, str]]:
    """Queued jobs whose `queue` is a bare queue name, as an API of the release before lanes wrote them during
    a rolling upgrade (migration 0017): moved to the default model's lane of that name and undispatched, to
    be published there; their tallies move with them (the tally triggers see status changes only). Returns
    (id, lane) of the jobs moved. One statement, an index probe per name (ix_jobs_queued)."""
    statement = (
        update(Job).where(status_is(QUEUED), Job.queue.in_(queue_names))
        .values(queue=lane_of(default_model, "") + Job.queue, dispatched_at=None, updated_at=now)
        .returning(Job.id, Job.tenant_id, Job.params, Job.queue)
        .execution_options(synchronize_session=False)
    )
    moved: list[tuple[str, str]] = []
    for job_id, tenant_id, params, lane in session.execute(statement).all():
        bound = output_bound(params or {})
        session.add_all([
            JobTallyDelta(queue=queue_of(lane), tenant_id=tenant_id, status=QUEUED, jobs=-1,
                          output_bound=-bound),
            JobTallyDelta(queue=lane, tenant_id=tenant_id, status=QUEUED, jobs=1, output_bound=bound),
        ])
        moved.append((job_id, lane))
    session.commit()
    return moved


def output_bound(params: dict[str, Any]) -> int:
    """The most output a job may still write, as the tally triggers count it (migration 0016)."""
    return int(params.get("max_tokens") or DEFAULT_MAX_TOKENS) * int(params.get("n") or 1)


def requeue_unheld(
    session: Session, worker_id: str, held: set[tuple[str, int]], started_before: datetime, now: datetime
) -> list[tuple[str, str]]:
    """running -> queued for this live worker's attempts that it does not hold: claimed, but the claim's
    answer never reached the runner (the connection dropped after the commit). Only attempts started before
    `started_before`, so a claim still on its way to the runner is left alone. The claim is given back
    (attempts - 1): the attempt never ran, so it neither shows as a run nor counts toward max_attempts."""
    query = select(Job.id, Job.attempts, Job.queue).where(
        Job.status == RUNNING, Job.worker_id == worker_id, Job.started_at < started_before)
    lost = [(job_id, attempt, queue) for job_id, attempt, queue in session.execute(query)
            if (job_id, attempt) not in held]
    requeued = []
    for job_id, attempt, queue in lost:
        still_held_here = and_(Job.worker_id == worker_id, Job.attempts == attempt)
        if transition(session, job_id, (RUNNING,), still_held_here, status=QUEUED, attempts=attempt - 1,
                      worker_id=None, dispatched_at=None, first_token_at=None, updated_at=now):
            requeued.append((job_id, queue))
    return requeued


def expire_overdue(session: Session, now: datetime, job_ids: list[str] | None = None,
                   batch: int = EXPIRE_BATCH) -> list[str]:
    """queued jobs past expires_at -> expired (only those of `job_ids` when given); commits and returns
    their ids. `batch` at a time, the earliest expiry first, each committed: a wave of expiries never makes
    one long transaction, and the read follows ix_jobs_queued_expiry (the planner, misled by the finished
    rows' past expiries, would otherwise read every queued row to find none)."""
    overdue = [status_is(QUEUED), Job.expires_at.is_not(None), Job.expires_at <= now]
    if job_ids is not None:
        overdue.append(Job.id.in_(job_ids))
    due = unlocked(*overdue).order_by(Job.expires_at).limit(batch)
    expired: list[str] = []
    while True:
        # Two statements, as in a claim: PostgreSQL may run an `IN (SELECT ... LIMIT)` again per row.
        ids = list(session.execute(due).scalars())
        if ids:
            statement = update(Job).where(Job.id.in_(ids), *overdue).values(**expired_values(now))
            ids = list(session.execute(statement.returning(Job.id)
                                       .execution_options(synchronize_session=False)).scalars())
        if ids:
            record_finished(session, ids, EXPIRED, now)
        session.commit()
        expired += ids
        if len(ids) < batch:
            return expired
