"""How many jobs each queue holds scheduled, queued and running (per tenant, and the output its queued and
running jobs may still write), without counting the backlog: read from tallies that triggers on jobs keep
(migration 0016; `scheduled` since 0026).

Every transaction that moves a job into or out of `scheduled`, `queued` or `running` appends a delta row (+1
or -1, with the job's output bound, max_tokens x n) in the same transaction, so a committed change is
counted exactly once and an aborted one not at all, and two transactions never wait on one counter row. A
read sums the folded rows (one per queue, tenant and status) and the deltas not folded yet: its cost follows
the tenants and the changes since the last fold, not the backlog. `fold` moves the deltas into the folded
rows: the reconciler calls it every round, and so does a read of the API's (`/v1/queues`, `/v1/scaling`,
`/metrics`, the console) that met FOLD_AT deltas or more (no worker may be running to fold: a fleet scaled
to zero still takes submits). A read inside a transaction that writes (a submit's admission and forecast)
never folds: the fold commits.

What reads them: admission (api/admission.py: a queue's and a tenant's queued jobs, a tenant's scheduled
ones), /v1/queues, /v1/scaling, /metrics and the console (counts), deadline forecasts (the output bound of
the work ahead). Scheduled jobs are apart: not in a queue's depth, its load (the scaling signal) nor its
output bound, until they are due and queued.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, literal, select, text, union_all
from sqlalchemy.orm import Session

from conveyor.core.lifecycle import QUEUED, RUNNING, SCHEDULED
from conveyor.core.store import queued_streams
from conveyor.core.store.tables import JobTally, JobTallyDelta

FOLD_AT = 2000  # deltas a read may meet before it folds them
FOLD_LOCK = (0x636F6E76, zlib.crc32(b"job_tallies") - (1 << 31))  # one folder at a time (PostgreSQL)

_FOLD_POSTGRES = text("""
    WITH moved AS (DELETE FROM job_tally_deltas RETURNING queue, tenant_id, status, jobs, output_bound)
    INSERT INTO job_tallies AS t (queue, tenant_id, status, jobs, output_bound)
    SELECT queue, tenant_id, status, sum(jobs), sum(output_bound) FROM moved
    GROUP BY queue, tenant_id, status ORDER BY queue, tenant_id, status
    ON CONFLICT (queue, tenant_id, status)
    DO UPDATE SET jobs = t.jobs + excluded.jobs, output_bound = t.output_bound + excluded.output_bound""")
_FOLD_SQLITE = text("""
    INSERT INTO job_tallies (queue, tenant_id, status, jobs, output_bound)
    SELECT queue, tenant_id, status, sum(jobs), sum(output_bound) FROM job_tally_deltas WHERE id <= :last
    GROUP BY queue, tenant_id, status
    ON CONFLICT (queue, tenant_id, status)
    DO UPDATE SET jobs = jobs + excluded.jobs, output_bound = output_bound + excluded.output_bound""")


@dataclass
class QueueTally:
    queued: int = 0
    running: int = 0
    output_bound: int = 0  # the most output its queued and running jobs may still write
    scheduled: int = 0  # not due yet: in neither the load nor the output bound

    @property
    def load(self) -> int:
        """The scaling signal: running jobs count, since a worker holds them (scaling down on queued jobs
        alone would take busy workers for idle ones)."""
        return self.queued + self.running


@dataclass(frozen=True)
class QueueCounts:
    queued: int
    running: int
    oldest_queued_at: datetime | None
    scheduled: int = 0  # not due yet: apart from the depth


def queue_counts(session: Session, now: datetime, tenant_id: str | None = None, *, may_fold: bool = False,
                 ) -> dict[str, QueueCounts]:
    """Scheduled, queued and running jobs per queue, and when its oldest claimable queued job was created
    (one index probe per stream: queued_streams.stream_loads); with `tenant_id`, that tenant's jobs only.
    `may_fold`: as `tallies`."""
    out = {}
    for queue, tally in tallies(session, tenant_id, may_fold=may_fold).items():
        streams = queued_streams.stream_loads(session, queue, now, 1, tenant_id) if tally.queued else []
        out[queue] = QueueCounts(tally.queued, tally.running,
                                 min((s.oldest_queued_at for s in streams), default=None), tally.scheduled)
    return out


def tallies(session: Session, tenant_id: str | None = None, queue: str | None = None, *,
            may_fold: bool = False) -> dict[str, QueueTally]:
    """Per queue with scheduled, queued or running jobs (with `tenant_id`, that tenant's only; with `queue`,
    that queue only), their counts and output bound. `may_fold`: the caller's session holds no write, so
    when the read met FOLD_AT deltas it folds them (committing that session)."""
    parts = []
    for table, is_delta in ((JobTally, 0), (JobTallyDelta, 1)):
        part = select(table.queue, table.status, table.jobs, table.output_bound,
                      literal(is_delta).label("is_delta"))
        if tenant_id is not None:
            part = part.where(table.tenant_id == tenant_id)
        if queue is not None:
            part = part.where(table.queue == queue)
        parts.append(part)
    rows = union_all(*parts).subquery()
    query = select(rows.c.queue, rows.c.status, func.sum(rows.c.jobs), func.sum(rows.c.output_bound),
                   func.sum(rows.c.is_delta)).group_by(rows.c.queue, rows.c.status)
    out: dict[str, QueueTally] = {}
    deltas = 0
    for name, status, jobs, bound, delta_rows in session.execute(query):
        deltas += int(delta_rows or 0)
        if jobs:
            _add(out.setdefault(name, QueueTally()), status, int(jobs), int(bound or 0))
    if may_fold and deltas >= FOLD_AT:
        fold(session)
    return out


def count(session: Session, queue: str, status: str, tenant_id: str | None = None) -> int:
    """The queue's jobs in `status` (scheduled, queued or running); with `tenant_id`, that tenant's only.
    One statement: the folded rows by primary key, and the deltas not folded yet (admission's read)."""
    parts = []
    for table in (JobTally, JobTallyDelta):
        part = select(table.jobs).where(table.queue == queue, table.status == status)
        if tenant_id is not None:
            part = part.where(table.tenant_id == tenant_id)
        parts.append(part)
    rows = union_all(*parts).subquery()
    return int(session.execute(select(func.coalesce(func.sum(rows.c.jobs), 0))).scalar_one())


def per_tenant(session: Session) -> dict[str, QueueTally]:
    """Per tenant with scheduled, queued or running jobs, its counts over every queue (one statement)."""
    parts = [select(table.tenant_id, table.status, table.jobs, table.output_bound)
             for table in (JobTally, JobTallyDelta)]
    rows = union_all(*parts).subquery()
    query = (select(rows.c.tenant_id, rows.c.status, func.sum(rows.c.jobs), func.sum(rows.c.output_bound))
             .group_by(rows.c.tenant_id, rows.c.status))
    out: dict[str, QueueTally] = {}
    for tenant_id, status, jobs, bound in session.execute(query):
        if jobs:
            _add(out.setdefault(tenant_id, QueueTally()), status, int(jobs), int(bound or 0))
    return out


def _add(tally: QueueTally, status: str, jobs: int, bound: int) -> None:
    """Counts `jobs` of `status` (with their output `bound`) into `tally`."""
    if status == SCHEDULED:
        tally.scheduled += jobs
        return
    if status == QUEUED:
        tally.queued += jobs
    elif status == RUNNING:
        tally.running += jobs
    tally.output_bound += bound


def fold(session: Session) -> None:
    """Moves the deltas into the folded rows and commits. PostgreSQL: skipped while another session folds."""
    if session.get_bind().dialect.name == "postgresql":
        if not session.execute(select(func.pg_try_advisory_xact_lock(*FOLD_LOCK))).scalar_one():
            session.commit()
            return
        session.execute(_FOLD_POSTGRES)
    else:  # one writer at a time: the deltas up to `last` are all committed, and no other fold runs
        last = session.execute(select(func.max(JobTallyDelta.id))).scalar_one()
        if last is not None:
            session.execute(_FOLD_SQLITE, {"last": last})
            session.execute(JobTallyDelta.__table__.delete().where(JobTallyDelta.id <= last))
    session.commit()
