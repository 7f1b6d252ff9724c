"""Reading jobs: by id, by idempotency key, a page of a tenant's, and the counts admission, metrics and
the console ask for."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, func, literal_column, select
from sqlalchemy.orm import Session

from conveyor.core.lifecycle import QUEUED, SUCCEEDED, TERMINAL_STATUSES
from conveyor.core.protocol.service_tiers import goodput_tier
from conveyor.core.store import job_tallies, outcome_counts
from conveyor.core.store.jobs.transitions import status_is
from conveyor.core.store.paging import newest_first
from conveyor.core.store.tables import Job


def get(session: Session, job_id: str, tenant_id: str | None = None) -> Job | None:
    """The job, or None; with `tenant_id`, another tenant's job is None too."""
    query = select(Job).where(Job.id == job_id).execution_options(populate_existing=True)
    if tenant_id is not None:
        query = query.where(Job.tenant_id == tenant_id)
    return session.execute(query).scalar_one_or_none()


def get_many(session: Session, job_ids: list[str]) -> list[Job]:
    """The jobs of these ids that exist, in no particular order."""
    query = select(Job).where(Job.id.in_(job_ids)).execution_options(populate_existing=True)
    return list(session.execute(query).scalars())


def by_idempotency_key(session: Session, tenant_id: str, key: str) -> Job | None:
    query = select(Job).where(Job.tenant_id == tenant_id, Job.idempotency_key == key)
    return session.execute(query.execution_options(populate_existing=True)).scalar_one_or_none()


def page(
    session: Session,
    tenant_id: str | None,
    *,
    limit: int,
    status: str | None = None,
    lanes: list[str] | None = None,
    before: tuple[datetime, str] | None = None,
    batch_id: str | None = None,
    since: datetime | None = None,
    metadata: tuple[str, str] | None = None,
) -> list[Job]:
    """Newest first by (created_at, id); `before` is the last (created_at, id) of the previous page;
    `lanes`: only jobs of these (core/lanes.py); `since`: created after it; `metadata` (key, value): whose
    metadata has that key with that text value; `tenant_id` None: every tenant's (the console's admin view:
    no index serves it, so it reads the table's newest rows through a sort)."""
    query = select(Job)
    if tenant_id is not None:
        query = query.where(Job.tenant_id == tenant_id)
    if status is not None:
        query = query.where(Job.status == status)
    if lanes is not None:
        query = query.where(Job.queue.in_(lanes))
    if batch_id is not None:
        query = query.where(Job.batch_id == batch_id)
    if since is not None:
        query = query.where(Job.created_at > since)
    if metadata is not None:
        query = query.where(Job.meta[metadata[0]].as_string() == metadata[1])
    return list(session.execute(newest_first(query, Job, limit=limit, before=before)).scalars())


def count_queued(session: Session, queue: str, tenant_id: str | None = None) -> int:
    """The queue's queued jobs; with `tenant_id`, that tenant's only. Read from the job tallies
    (core/store/job_tallies.py), never counted from the rows: its cost follows the tenants and the deltas not
    folded yet, not the backlog."""
    return job_tallies.count(session, queue, QUEUED, tenant_id)


def succeeded_per_minute(session: Session, lane: str, now: datetime, minutes: int,
                         tenant_id: str | None = None) -> list[int]:
    """The lane's jobs that succeeded in each of the last `minutes` minutes, oldest first; with `tenant_id`,
    that tenant's only. One statement of `minutes` counts, each a range of ix_jobs_succeeded_finished."""
    def in_minute(ago: int) -> ColumnElement[int]:
        end = now - timedelta(minutes=ago)
        rows = select(func.count()).where(status_is(SUCCEEDED), Job.queue == lane, Job.finished_at <= end,
                                          Job.finished_at > end - timedelta(minutes=1))
        if tenant_id is not None:
            rows = rows.where(Job.tenant_id == tenant_id)
        return rows.scalar_subquery()

    counts = session.execute(select(*(in_minute(ago) for ago in range(minutes - 1, -1, -1)))).one()
    return [int(n) for n in counts]


def failures_since(session: Session, since: datetime, tenant_id: str | None = None,
                   ) -> list[tuple[str, str, int]]:
    """(lane, error code, jobs) of the jobs that failed or expired since `since`, the most first; with
    `tenant_id`, that tenant's only (ix_jobs_failed_finished: the failures of that time, not the table)."""
    failed = Job.status.in_((literal_column("'failed'"), literal_column("'expired'")))
    code = func.coalesce(Job.error_code, "unknown")
    query = (select(Job.queue, code, func.count()).where(failed, Job.finished_at >= since)
             .group_by(Job.queue, code).order_by(func.count().desc(), Job.queue, code))
    if tenant_id is not None:
        query = query.where(Job.tenant_id == tenant_id)
    return [(lane, str(error), int(n)) for lane, error, n in session.execute(query)]


DeadlineCounts = dict[str, dict[str, dict[str, int]]]  # queue -> goodput tier -> outcome -> jobs


def deadline_counts(session: Session, since: datetime, tenant_id: str | None = None) -> DeadlineCounts:
    """Per queue and goodput tier (core/protocol/service_tiers.py goodput_tier), the jobs with a deadline that
    ended since `since`, by outcome (on_time, late, missed: the metrics' rule,
    outcome_counts.deadline_outcome); with `tenant_id`, that tenant's only. Only tiers with such jobs
    appear."""
    outcome = outcome_counts.deadline_outcome_sql()
    query = (
        select(Job.queue, Job.service_tier, outcome, func.count())
        .where(Job.deadline_at.is_not(None), Job.finished_at >= since, Job.status.in_(TERMINAL_STATUSES))
        .group_by(Job.queue, Job.service_tier, outcome)
    )
    if tenant_id is not None:
        query = query.where(Job.tenant_id == tenant_id)
    counts: DeadlineCounts = {}
    for queue, tier, kind, n in session.execute(query):
        by_outcome = counts.setdefault(queue, {}).setdefault(goodput_tier(tier), {})
        by_outcome[kind] = by_outcome.get(kind, 0) + int(n)  # auto, default and none are one tier
    return counts


@dataclass(frozen=True)
class AttemptState:
    status: str
    attempts: int
    worker_id: str | None


def attempt_states(session: Session, job_ids: list[str]) -> dict[str, AttemptState]:
    """Status, attempt number and holder of each job: a worker's check that its attempts are still current."""
    if not job_ids:
        return {}
    query = select(Job.id, Job.status, Job.attempts, Job.worker_id).where(Job.id.in_(job_ids))
    return {job_id: AttemptState(status, attempts, worker_id)
            for job_id, status, attempts, worker_id in session.execute(query)}
