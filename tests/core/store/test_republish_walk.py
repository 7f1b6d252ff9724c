"""The republish walk's store side (core/store/republish_walk.py), on SQLite and PostgreSQL: a walk goes
lane by lane in name order, each in (dispatched_at, created_at, id) order, over the queued jobs dispatched
before `lost_before` only, resumes after its cursor whatever session reads it, and ends after the last lane;
a new walk starts over with the next generation."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from sqlalchemy.orm import Session

from conveyor.core.store import jobs, republish_walk
from conveyor.core.store.tables import DEFAULT_TENANT

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
LANES = ["m:interactive", "m:documents"]


def _queued(session: Session, queue: str, dispatched_at: datetime | None) -> str:
    new = jobs.NewJob(tenant_id=DEFAULT_TENANT, queue=queue, prompt="p", messages=None, params={}, meta=None,
                      webhook=None, idempotency_key=None, request_hash="h", prompt_tokens=1, ttl_s=None,
                      timeout_s=None)
    job_id = jobs.add(session, new, T0).id
    if dispatched_at is not None:
        jobs.mark_dispatched(session, [job_id], dispatched_at)
    return job_id


def _walk_all(session: Session, batch: int) -> list[list[str]]:
    """Every batch of the walk under way, each read and advanced as a reconciler does."""
    batches = []
    while (walk := republish_walk.take(session)) is not None:
        found = republish_walk.next_batch(session, walk, batch)
        batches.append([lost.job_id for lost in found])
        republish_walk.advance(session, walk, found, len(found) < batch, LANES)
    return batches


def test_a_walk_covers_each_lane_in_order_and_nothing_dispatched_after_the_loss(session: Session) -> None:
    # Dispatched out of creation order, two at one instant: the index's order (time, created, id) decides.
    late, tie_a, tie_b = (_queued(session, "m:interactive", T0 + timedelta(seconds=s)) for s in (3, 1, 1))
    document = _queued(session, "m:documents", T0 + timedelta(seconds=2))
    _queued(session, "m:interactive", T0 + timedelta(seconds=10))  # published after the loss: kept
    _queued(session, "m:interactive", None)  # never published: the undispatched rule's
    running = _queued(session, "m:interactive", T0)
    assert jobs.claim(session, running, "w1", T0) is not None

    assert republish_walk.begin(session, T0 + timedelta(seconds=5), LANES) == 1
    assert _walk_all(session, 2) == [[document], sorted([tie_a, tie_b]), [late]]
    assert republish_walk.take(session) is None  # ended

    assert republish_walk.begin(session, T0 + timedelta(seconds=5), LANES) == 2  # lost again: from the start
    walk = republish_walk.take(session)
    assert walk is not None and (walk.lane, walk.after, walk.published) == ("m:documents", None, 0)


def test_a_walk_resumes_after_its_cursor_and_counts_what_went_out(session: Session) -> None:
    backlog = [_queued(session, "m:interactive", T0 + timedelta(seconds=s)) for s in range(5)]
    republish_walk.begin(session, T0 + timedelta(minutes=1), ["m:interactive"])
    walk = republish_walk.take(session)
    assert walk is not None
    first = republish_walk.next_batch(session, walk, 3)
    republish_walk.advance(session, walk, first[:2], False, ["m:interactive"])  # the broker took two
    walk = republish_walk.take(session)
    assert walk is not None and walk.published == 2 and walk.after == first[1].key
    assert [lost.job_id for lost in republish_walk.next_batch(session, walk, 10)] == backlog[2:]
