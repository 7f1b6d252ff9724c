"""queued -> running: a worker's claim of the jobs it was handed, in one statement."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import bindparam, or_, update
from sqlalchemy.orm import Session

from conveyor.core.lifecycle import QUEUED, RUNNING
from conveyor.core.store import webhook_events
from conveyor.core.store.jobs.recovery import expire_overdue
from conveyor.core.store.jobs.transitions import lock_in_id_order
from conveyor.core.store.tables import Job


def claim(session: Session, job_id: str, worker_id: str, now: datetime) -> Job | None:
    """`claim_many` of one job: the claimed row, or None."""
    claimed = claim_many(session, [job_id], worker_id, now)
    return claimed[0] if claimed else None


def claim_many(session: Session, job_ids: list[str], worker_id: str, now: datetime) -> list[Job]:
    """queued -> running (attempts + 1, started_at = now) for every job of `job_ids` still queued, in one
    statement that returns the claimed rows (no read-back that a dropped connection could separate from the
    commit), in the order of `job_ids`. Jobs not queued are left out; those whose ttl has passed are expired
    in the same call."""
    if not job_ids:
        return []
    not_expired = or_(Job.expires_at.is_(None), Job.expires_at > now)
    claimable = lock_in_id_order(session, Job.id.in_(job_ids), Job.status == QUEUED, not_expired)
    claimed = {job.id: job for job in claim_ids(session, claimable, worker_id, now)}
    if claimed:
        webhook_events.enqueue_started_events(session, list(claimed.values()), now)
    session.commit()
    if len(claimed) < len(set(job_ids)):
        expire_overdue(session, now, [job_id for job_id in job_ids if job_id not in claimed])
    return [claimed[job_id] for job_id in dict.fromkeys(job_ids) if job_id in claimed]


def claim_ids(session: Session, job_ids: list[str], worker_id: str, now: datetime) -> list[Job]:
    """queued -> running (attempts + 1, started_at = now, held by worker_id) for those of `job_ids` still
    queued, not committed: a claim's one write (here and in core/store/fair_share.py, whose claim adds the
    `job.started` events of all it claimed, as claim_many does). Returns those rows."""
    if not job_ids:
        return []
    params = {"b_ids": job_ids, "b_worker_id": worker_id, "b_now": now}
    return list(session.execute(_CLAIM_IDS, params).scalars())


_CLAIM_IDS = (  # built once: the claim runs for every job
    update(Job)
    .where(Job.id.in_(bindparam("b_ids", expanding=True)), Job.status == QUEUED)
    .values(status=RUNNING, attempts=Job.attempts + 1, first_token_at=None,
            worker_id=bindparam("b_worker_id", type_=Job.worker_id.type),
            started_at=bindparam("b_now", type_=Job.started_at.type),
            updated_at=bindparam("b_now", type_=Job.updated_at.type))
    .returning(Job)
    .execution_options(synchronize_session=False, populate_existing=True)
)


def unclaim(session: Session, job_ids: list[str]) -> None:
    """running -> queued again for jobs this transaction just claimed and will not run (they did not fit the
    claim's places): as if never claimed, not committed."""
    session.execute(update(Job).where(Job.id.in_(job_ids), Job.status == RUNNING)
                    .values(status=QUEUED, attempts=Job.attempts - 1, worker_id=None, started_at=None)
                    .execution_options(synchronize_session=False))
