"""queued -> running: a worker's claim of the jobs it was handed, in one statement.

A claim's one write returns the claimed rows, so nothing reads them back (a read a dropped connection could
separate from the commit). The fair claim (core/store/fair_share.py), which runs for every group of jobs a
worker starts, takes them as plain rows of the columns a worker starts a job from (`ClaimedJob`, as
core/store/jobs/records.py reads jobs for clients): an ORM object per row cost more than the rest of the
claim. Its RETURNING also says, per job, whether its tenant has
an enabled webhook subscription and which prefix-cache namespace it is in: the claim reads the subscriptions
only when there are some, and the runner salts the job's prefix cache without another read.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Row, Update, bindparam, literal_column, or_, select, update
from sqlalchemy.orm import Session

from conveyor.core.lifecycle import QUEUED, RUNNING
from conveyor.core.store import webhook_events
from conveyor.core.store.jobs.recovery import expire_overdue
from conveyor.core.store.jobs.transitions import lock_in_id_order
from conveyor.core.store.tables import Job, Tenant

# A job as a fair claim returns it: CLAIMED, the columns a worker starts it from, and `subscribed`
# (webhook_events.TENANT_SUBSCRIBED) and `cache_namespace` (its tenant's: core/store/tenants.py cache_salt).
ClaimedJob = Row[Any]
CLAIMED = ("id", "tenant_id", "batch_id", "queue", "kind", "prompt", "inputs", "messages", "params", "chat",
           "webhook", "timeout_s", "deadline_at", "priority", "created_at", "attempts")

_JOBS = Job.__table__
_CLAIM_VALUES: dict[str, Any] = dict(
    status=RUNNING, attempts=_JOBS.c.attempts + 1, first_token_at=None,
    worker_id=bindparam("b_worker_id", type_=_JOBS.c.worker_id.type),
    started_at=bindparam("b_now", type_=_JOBS.c.started_at.type),
    updated_at=bindparam("b_now", type_=_JOBS.c.updated_at.type))
# The tenant's namespace, by the jobs table's name (SQLite writes RETURNING's columns unqualified).
_CACHE_NAMESPACE = (select(Tenant.cache_namespace).where(Tenant.id == literal_column("jobs.tenant_id"))
                    .scalar_subquery().label("cache_namespace"))
# Only these: a RETURNING of every column cost a third of the claim (decoding, and PostgreSQL's driver
# describing each column anew), and made the statement too long for the driver's cache of parsed queries.
_CLAIMED_COLUMNS = (*(_JOBS.c[name] for name in CLAIMED), webhook_events.TENANT_SUBSCRIBED, _CACHE_NAMESPACE)


def claim(session: Session, job_id: str, worker_id: str, now: datetime) -> Job | None:
    """`claim_many` of one job: the claimed row, or None."""
    claimed = claim_many(session, [job_id], worker_id, now)
    return claimed[0] if claimed else None


def claim_many(session: Session, job_ids: list[str], worker_id: str, now: datetime) -> list[Job]:
    """queued -> running (attempts + 1, started_at = now) for every job of `job_ids` still queued, in one
    statement that returns the claimed rows, in the order of `job_ids`. Jobs not queued are left out; those
    whose ttl has passed are expired in the same call."""
    if not job_ids:
        return []
    not_expired = or_(Job.expires_at.is_(None), Job.expires_at > now)
    claimable = lock_in_id_order(session, Job.id.in_(job_ids), Job.status == QUEUED, not_expired)
    params = {"b_ids": claimable, **claim_params(worker_id, now)}
    rows = session.execute(_CLAIM_IDS, params).all() if claimable else []
    claimed = {job.id: job for job, _ in rows}
    if claimed:
        webhook_events.enqueue_started_events(session, list(claimed.values()), now,
                                              {job.tenant_id for job, subscribed in rows if subscribed})
    session.commit()
    if len(claimed) < len(set(job_ids)):
        expire_overdue(session, now, [job_id for job_id in job_ids if job_id not in claimed])
    return [claimed[job_id] for job_id in dict.fromkeys(job_ids) if job_id in claimed]


def claim_ids(session: Session, job_ids: list[str], worker_id: str, now: datetime) -> list[Job]:
    """queued -> running (attempts + 1, started_at = now, held by worker_id) for those of `job_ids` still
    queued, not committed: a claim's one write. Returns those rows."""
    if not job_ids:
        return []
    params = {"b_ids": job_ids, **claim_params(worker_id, now)}
    return [job for job, _ in session.execute(_CLAIM_IDS, params)]


def claim_statement(chosen: ColumnElement[bool]) -> Update:
    """A claim's one write, for the jobs `chosen` picks that are still queued: queued -> running, attempts +
    1, started_at = now, held by the worker (parameters: `claim_params`), returning each as a ClaimedJob.
    Build it once: building costs more than running it."""
    return update(_JOBS).where(chosen, _JOBS.c.status == QUEUED).values(**_CLAIM_VALUES).returning(
        *_CLAIMED_COLUMNS)


def claim_params(worker_id: str, now: datetime) -> dict[str, object]:
    return {"b_worker_id": worker_id, "b_now": now}


def claimed_rows(session: Session, statement: Update, params: dict[str, object]) -> list[ClaimedJob]:
    """Runs a `claim_statement` (on the session's connection: its rows are no ORM objects)."""
    return list(session.connection().execute(statement, params))


# claim_many's and claim_ids', on the mapped class: their callers get ORM objects.
_CLAIM_IDS = (update(Job).where(Job.id.in_(bindparam("b_ids", expanding=True)), Job.status == QUEUED)
              .values(**_CLAIM_VALUES).returning(Job, webhook_events.TENANT_SUBSCRIBED)
              .execution_options(synchronize_session=False, populate_existing=True))


def unclaim(session: Session, job_ids: list[str]) -> None:
    """running -> queued again for jobs this transaction just claimed and will not run (they did not fit the
    claim's places): as if never claimed, not committed."""
    session.execute(update(Job).where(Job.id.in_(job_ids), Job.status == RUNNING)
                    .values(status=QUEUED, attempts=Job.attempts - 1, worker_id=None, started_at=None)
                    .execution_options(synchronize_session=False))
