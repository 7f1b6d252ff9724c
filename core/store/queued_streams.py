"""Reads of a queue's backlog whose cost follows the number of streams and the jobs asked for, not the
backlog's size (issue 32): what a fair claim reads under its queue's lock.

- `stream_loads`: each stream's queued jobs (counted up to a cap) and its oldest, found by a skip scan of
  ix_jobs_queued: one index probe per tenant and per batch, then a bounded count per stream.
- `most_urgent` (`urgent_ids`): a stream's next jobs in urgency order, merged from two index-ordered reads of
  at most n rows each (ix_jobs_queued_slack for the jobs with a deadline ahead, ix_jobs_queued_urgency for
  the first by arrival), locked `FOR UPDATE SKIP LOCKED`, instead of sorting the stream's whole backlog; a
  fair claim takes them in the same statement that reads them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    CompoundSelect,
    Integer,
    Select,
    bindparam,
    case,
    func,
    literal,
    null,
    or_,
    select,
    union,
    union_all,
)
from sqlalchemy.orm import Session

from conveyor.core.lifecycle import QUEUED
from conveyor.core.store.jobs.transitions import status_is
from conveyor.core.store.tables import Job

# The statements' parameters, bound by name at each execution (not named as columns are: a claim's UPDATE
# reserves those names).
_QUEUE = bindparam("of_queue", type_=Job.queue.type)
_TENANT = bindparam("of_tenant", type_=Job.tenant_id.type)
_BATCH = bindparam("of_batch", type_=Job.batch_id.type)
_NOW = bindparam("now", type_=Job.expires_at.type)
_CAP = bindparam("cap", type_=Integer)
_N = bindparam("n", type_=Integer)
_NOT_EXPIRED = or_(Job.expires_at.is_(None), Job.expires_at > _NOW)


@dataclass(frozen=True)
class QueuedStream:
    tenant_id: str
    batch_id: str | None  # None: the tenant's own submissions
    queued: int  # at most the cap asked for
    oldest_queued_at: datetime


def stream_loads(session: Session, queue: str, now: datetime, cap: int, tenant_id: str | None = None,
                 ) -> list[QueuedStream]:
    """The streams of `queue` with claimable jobs (queued, not past their ttl): each one's count, up to
    `cap`, and its oldest job's creation; with `tenant_id`, that tenant's streams only. Expired jobs the
    reconciler has not swept yet are skipped."""
    params = stream_loads_params(queue, now, cap, tenant_id)
    rows = session.connection().execute(stream_loads_statement(tenant_id is not None), params)  # no ORM layer
    return [QueuedStream(tenant_id, batch_id, int(count), oldest)
            for tenant_id, batch_id, count, oldest in rows if count]


def stream_loads_params(queue: str, now: datetime, cap: int, tenant_id: str | None = None,
                        ) -> dict[str, object]:
    return {"of_queue": queue, "now": now, "cap": cap, "of_tenant": tenant_id}


@functools.cache
def stream_loads_statement(one_tenant: bool) -> CompoundSelect[Any]:
    """stream_loads' statement, built once (its parameters: `stream_loads_params`; its rows: tenant_id,
    batch_id, queued, oldest, a stream with nothing claimable counting 0): building it cost more than
    running it. A fair claim reads its tenants' shares in the same statement (core/store/fair_share.py)."""
    queued = (Job.queue == _QUEUE, status_is(QUEUED))
    tenants = (select(_TENANT.label("tenant_id")).cte("queued_tenants") if one_tenant
               else _distinct_tenants(queued))
    batches = _distinct_batches(queued, tenants)
    # Two branches, so that each correlated read matches its stream by one indexable condition.
    own = (tenants, tenants.c.tenant_id, null(), Job.batch_id.is_(None), tenants.c.tenant_id.is_not(None))
    batch = (batches, batches.c.tenant_id, batches.c.batch_id, Job.batch_id == batches.c.batch_id,
             batches.c.batch_id.is_not(None))
    return union_all(*(_stream_load(*stream, queued) for stream in (own, batch)))


def _stream_load(source: Any, tenant: ColumnElement[Any], batch: ColumnElement[Any],
                 of_batch: ColumnElement[bool], listed: ColumnElement[bool],
                 queued: tuple[ColumnElement[bool], ...]) -> Select[Any]:
    """Per stream (tenant, batch) listed in `source` (a CTE), its claimable jobs counted up to `cap`, and
    its oldest."""
    claimable = (*queued, Job.tenant_id == tenant, of_batch, _NOT_EXPIRED)
    # Ordered by the batch too (one value in the stream), so that the order is ix_jobs_queued's: by
    # (created_at, id) alone the planner may walk the tenant's whole history in ix_jobs_tenant_created.
    first = select(Job.created_at).where(*claimable).order_by(Job.batch_id, Job.created_at, Job.id).limit(1)
    # Correlated to the listed stream by hand: a subquery in FROM is not correlated by default.
    capped = select(literal(1)).where(*claimable).limit(_CAP).correlate(source).subquery()
    count = select(func.count()).select_from(capped).scalar_subquery()
    return select(tenant.label("tenant_id"), batch.label("batch_id"), count.label("queued"),
                  first.scalar_subquery().label("oldest")).where(listed)


def _distinct_tenants(queued: tuple[ColumnElement[bool], ...]) -> Any:
    """The tenants with queued jobs in the queue, one index probe each (a recursive skip scan); the last
    row is NULL."""
    def after(previous: ColumnElement[Any] | None) -> Any:
        later = () if previous is None else (Job.tenant_id > previous,)
        return select(Job.tenant_id).where(*queued, *later).order_by(Job.tenant_id).limit(1).scalar_subquery()

    tenants = select(after(None).label("tenant_id")).cte("queued_tenants", recursive=True)
    return tenants.union_all(select(after(tenants.c.tenant_id)).where(tenants.c.tenant_id.is_not(None)))


def _distinct_batches(queued: tuple[ColumnElement[bool], ...], tenants: Any) -> Any:
    """Each tenant's batches with queued jobs in the queue, one index probe each; a NULL row ends each
    tenant's list."""
    def after(tenant: ColumnElement[Any], previous: ColumnElement[Any] | None) -> Any:
        later = (Job.batch_id.is_not(None),) if previous is None else (Job.batch_id > previous,)
        return (select(Job.batch_id).where(*queued, Job.tenant_id == tenant, *later)
                .order_by(Job.batch_id).limit(1).scalar_subquery())

    first = select(tenants.c.tenant_id, after(tenants.c.tenant_id, None).label("batch_id")).where(
        tenants.c.tenant_id.is_not(None))
    batches = first.cte("queued_batches", recursive=True)
    return batches.union_all(select(batches.c.tenant_id, after(batches.c.tenant_id, batches.c.batch_id))
                             .where(batches.c.batch_id.is_not(None)))


def most_urgent(session: Session, queue: str, tenant_id: str, batch_id: str | None, n: int, now: datetime,
                *, by_arrival: bool = False) -> list[str]:
    """The ids of the stream's n most urgent claimable jobs, most urgent first, locked `FOR UPDATE SKIP
    LOCKED` (a row another transaction is changing, a cancel, is passed over): `urgent_ids`' read."""
    params = urgent_params(queue, tenant_id, batch_id, n, now)
    return list(session.connection().execute(urgent_ids(batch_id is not None, by_arrival), params).scalars())


def urgent_params(queue: str, tenant_id: str, batch_id: str | None, n: int, now: datetime,
                  ) -> dict[str, object]:
    """`urgent_ids`' parameters for the stream (tenant_id, batch_id) of `queue`."""
    return {"of_queue": queue, "of_tenant": tenant_id, "of_batch": batch_id, "n": n, "now": now}


@functools.cache
def urgent_ids(of_batch: bool, by_arrival: bool) -> Select[tuple[str]]:
    """The ids of a stream's n most urgent claimable jobs, most urgent first (its parameters:
    `urgent_params`): built once, and read as it is (`most_urgent`) or inside the claim that
    takes them (core/store/fair_share.py). Up to 2n rows are locked `FOR UPDATE SKIP LOCKED` until the
    transaction ends; the first n are the stream's.

    Urgency: priority (lower first), then, while its deadline is ahead, its latest start (`start_by`: the
    deadline minus its predicted run time, least slack first; set whenever the deadline is, by jobs.add and
    migration 0015), then arrival; a job whose deadline has passed keeps its arrival's place among those
    without one (engine/sequence.py Urgency orders the engine's admission the same way). `by_arrival`:
    oldest first, priority and deadline ignored.

    Two index-ordered reads of n rows each, merged and ranked in the same statement:
    - the jobs whose deadline is ahead, by (priority, start_by) (ix_jobs_queued_slack);
    - the stream's first n jobs by (priority, arrival), whatever their deadline (ix_jobs_queued_urgency).
      The jobs that rank by arrival (no deadline, or one passed) and belong in the n are all among them: any
      such job after those n ranks behind each of them (a lower priority, a deadline ahead at its priority,
      or an earlier arrival). Filtering this read to such jobs instead would walk past every job with a
      deadline ahead: the whole stream, when all have one."""
    of_stream = Job.batch_id == _BATCH if of_batch else Job.batch_id.is_(None)
    claimable = (Job.queue == _QUEUE, status_is(QUEUED), Job.tenant_id == _TENANT, of_stream, _NOT_EXPIRED)
    # Each read is ordered by the batch first (one value in the stream): PostgreSQL takes `batch_id IS NULL`
    # for no equality, so without it the index's order would not be seen and the whole stream sorted.
    if by_arrival:
        return _locked(select(Job.id).where(*claimable).order_by(Job.batch_id, Job.created_at, Job.id))
    columns = (Job.id, Job.priority, Job.deadline_at, Job.start_by, Job.created_at)
    ahead = select(*columns).where(*claimable, Job.deadline_at > _NOW).order_by(
        Job.batch_id, Job.priority, Job.start_by, Job.created_at, Job.id)
    first = select(*columns).where(*claimable).order_by(Job.batch_id, Job.priority, Job.created_at, Job.id)
    # FOR UPDATE is refused in a UNION's branches, not in a materialized CTE (read once, locks taken once).
    reads = [_locked(read).cte(name).prefix_with("MATERIALIZED")
             for name, read in (("urgent_ahead", ahead), ("urgent_first", first))]
    both = union(*(select(read) for read in reads)).subquery("urgent")  # a row read twice counts once
    return select(both.c.id).order_by(*_urgency(both.c)).limit(_N)


def _urgency(row: Any) -> tuple[ColumnElement[Any], ...]:
    """`urgent_ids`' order over the merged reads' columns: within a priority, a deadline ahead first (by its
    latest start), then arrival."""
    ahead = row.deadline_at > _NOW
    latest_start = case((ahead, func.coalesce(row.start_by, row.deadline_at)))  # NULL for the others
    return row.priority, case((ahead, 0), else_=1), latest_start, row.created_at, row.id


def _locked(query: Select[Any]) -> Select[Any]:
    return query.limit(_N).with_for_update(skip_locked=True)
