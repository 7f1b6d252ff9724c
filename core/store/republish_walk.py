"""A broker restart's republish: every queued job published again, walked from a cursor kept in one row,
with no UPDATE per job.

When the broker lost its queues (a Redis restarted without its data: BrokerPublisher.lost_messages() says so
once, to one caller in the fleet), every queued job handed to it before then may have lost its message.
`begin` records that moment, `lost_before` (when the broker said so: after whatever it lost was published),
in the one row of broker_republish and bumps its generation (a walk still under way starts over: its
messages may be gone too). From then on any reconciler walks the
lanes in name order, each in ix_jobs_dispatched_queued's order (dispatched_at, created_at, id) over its
queued jobs dispatched before `lost_before`, a batch at a time, in one transaction per batch: `take` locks
the row (FOR UPDATE SKIP LOCKED: one reconciler walks at a time, none waits, and no batch goes out twice),
`next_batch` reads the jobs after the cursor (an index range: its cost is the batch, never what was walked),
the caller publishes them, and `advance` moves the cursor past those that went out and commits. A walker
that dies mid-batch leaves the cursor where it was: the next walker publishes that batch again (duplicate
messages are harmless: a claim is a conditional UPDATE). After the last lane `lost_before` goes NULL.

Why no lost message is missed: a job whose message was lost was handed to the broker before it lost its
queues, so its dispatched_at (marked with the time its publishing began, never later: core/seams/
dispatch.py) is before `lost_before`, and the walk reaches its key unless the key moves behind the cursor.
A key moves only when the job is published again and marked: a mark made after the broker came back
publishes a message it keeps (the job leaves the range, or meets the walk again: a duplicate). The one
window left is a publisher that published before the broker lost its queues and committed its mark only
after the walk passed that time (stalled between the two for the whole restart): the empty-queue rule
(worker/reconciler.py) still finds that job once its queue drains. Jobs never marked (dispatched_at NULL)
are the undispatched rule's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select, tuple_, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from conveyor.core.lifecycle import QUEUED
from conveyor.core.store.jobs.transitions import status_is
from conveyor.core.store.tables import BrokerRepublish, Job

ROW_ID = 1

Key = tuple[datetime, datetime, str]  # (dispatched_at, created_at, id): ix_jobs_dispatched_queued's order


@dataclass(frozen=True)
class Walk:
    """A walk under way, as its row says: the jobs of `lane` after `after` (None: from its start) are next."""

    generation: int
    lost_before: datetime
    lane: str
    after: Key | None
    published: int  # so far, in this generation


@dataclass(frozen=True)
class Lost:
    """A queued job whose message may be lost: its id and its key in the walk's order."""

    job_id: str
    key: Key


def begin(session: Session, lost_before: datetime, lanes: Sequence[str]) -> int:
    """A new walk over `lanes` (every lane, in name order) of the jobs dispatched before `lost_before`;
    commits. Returns its generation."""
    assert lanes, "a walk needs a lane"
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    table = BrokerRepublish.__table__
    start = {"lost_before": lost_before, "lane": min(lanes), "after_dispatched_at": None,
             "after_created_at": None, "after_id": None, "published": 0}
    statement = insert(table).values(id=ROW_ID, generation=1, **start)
    statement = statement.on_conflict_do_update(index_elements=["id"],
                                                set_={"generation": table.c.generation + 1, **start})
    session.execute(statement)
    generation = session.execute(select(BrokerRepublish.generation)).scalar_one()
    session.commit()
    return int(generation)


def take(session: Session) -> Walk | None:
    """The walk under way, its row locked until the caller's transaction ends; None when there is none, or
    another reconciler holds it now (PostgreSQL: SKIP LOCKED; SQLite has one writer)."""
    row = BrokerRepublish
    query = (select(row.generation, row.lost_before, row.lane, row.after_dispatched_at, row.after_created_at,
                    row.after_id, row.published)  # columns, not the entity: never a stale identity-map copy
             .where(row.id == ROW_ID, row.lost_before.is_not(None)).with_for_update(skip_locked=True))
    found = session.execute(query).one_or_none()
    if found is None:
        return None
    generation, lost_before, lane, dispatched_at, created_at, job_id, published = found
    assert lane is not None, "a walk under way is in a lane"
    after = None
    if job_id is not None:
        assert dispatched_at is not None and created_at is not None, "a partial cursor"
        after = (dispatched_at, created_at, job_id)
    return Walk(generation, lost_before, lane, after, published)


def next_batch(session: Session, walk: Walk, limit: int) -> list[Lost]:
    """The next `limit` queued jobs of the walk's lane dispatched before `lost_before`, after its cursor, in
    the index's order (one range of ix_jobs_dispatched_queued)."""
    key = tuple_(Job.dispatched_at, Job.created_at, Job.id)
    query = (select(Job.id, Job.dispatched_at, Job.created_at)
             .where(status_is(QUEUED), Job.queue == walk.lane, Job.dispatched_at.is_not(None),
                    Job.dispatched_at < walk.lost_before)
             .order_by(Job.dispatched_at, Job.created_at, Job.id).limit(limit))
    if walk.after is not None:
        query = query.where(key > tuple_(*walk.after))
    return [Lost(job_id, (dispatched_at, created_at, job_id))
            for job_id, dispatched_at, created_at in session.execute(query)]


def advance(session: Session, walk: Walk, published: list[Lost], lane_done: bool, lanes: Sequence[str],
            ) -> Walk | None:
    """Moves the cursor past `published` (the batch's first jobs, in order); with `lane_done`, to the start
    of the next lane in `lanes`, or ends the walk after the last. Commits (and so frees the row). Returns the
    walk as it now stands; None: it ended."""
    after = published[-1].key if published else walk.after
    lane: str | None = walk.lane
    if lane_done:
        lane, after = min((name for name in lanes if name > walk.lane), default=None), None
    count = walk.published + len(published)
    dispatched_at, created_at, job_id = after or (None, None, None)
    moved = session.execute(
        update(BrokerRepublish)
        .where(BrokerRepublish.id == ROW_ID, BrokerRepublish.generation == walk.generation)
        .values(lane=lane, published=count, lost_before=walk.lost_before if lane is not None else None,
                after_dispatched_at=dispatched_at, after_created_at=created_at, after_id=job_id)
        .execution_options(synchronize_session=False))
    assert moved.rowcount == 1, "advance() follows take(), in its transaction"  # type: ignore[attr-defined]
    session.commit()
    return None if lane is None else Walk(walk.generation, walk.lost_before, lane, after, count)
