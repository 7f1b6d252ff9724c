"""The bounded reads of a queue's backlog (core/store/queued_streams.py), on SQLite and PostgreSQL: every
stream found by the skip scan with its oldest claimable job and its count up to the cap, and a stream's
next jobs in urgency order from the two index-ordered reads."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from sqlalchemy.orm import Session

from conveyor.core.store import batches, jobs, keys
from conveyor.core.store.queued_streams import QueuedStream, most_urgent, stream_loads

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)


def _add(session: Session, tenant: str, n: int, at: datetime, *, batch_id: str | None = None,
         queue: str = "documents", ttl_s: float | None = None, priority: int = 0,
         deadline_s: float | None = None) -> list[str]:
    keys.ensure_tenant(session, tenant, T0)
    session.commit()
    new = jobs.NewJob(tenant_id=tenant, queue=queue, prompt="p", messages=None, params={"max_tokens": 1},
                      meta=None, webhook=None, idempotency_key=None, request_hash="h", prompt_tokens=1,
                      ttl_s=ttl_s, timeout_s=None, batch_id=batch_id, priority=priority,
                      deadline_s=deadline_s)
    return [jobs.add(session, new, at + timedelta(milliseconds=i)).id for i in range(n)]


def _batch(session: Session, tenant: str) -> str:
    return batches.create(session, tenant_id=tenant, input_url="s3://b/in.jsonl", output_url="s3://b/out/",
                          queue="documents", now=T0).id


def test_every_stream_is_found_with_its_oldest_and_its_count_up_to_the_cap(session: Session) -> None:
    _add(session, "b", 7, T0 + timedelta(seconds=2))
    _add(session, "a", 2, T0 + timedelta(seconds=1))
    first, second = _batch(session, "a"), _batch(session, "a")
    _add(session, "a", 3, T0, batch_id=first)
    _add(session, "a", 1, T0 + timedelta(seconds=3), batch_id=second)
    c_batch = _batch(session, "c")
    _add(session, "c", 4, T0, batch_id=c_batch)  # batch lines only: no own stream
    _add(session, "d", 2, T0, queue="interactive")  # another queue
    _add(session, "e", 2, T0, ttl_s=1.0)  # past its ttl at the read
    claimed = _add(session, "f", 1, T0)
    assert jobs.claim(session, claimed[0], "w1", T0) is not None  # running: not queued

    found = stream_loads(session, "documents", T0 + timedelta(seconds=5), cap=5)

    at = [T0 + timedelta(seconds=s) for s in range(4)]
    assert sorted(found, key=lambda s: (s.tenant_id, s.batch_id or "")) == sorted([
        QueuedStream("a", None, 2, at[1]), QueuedStream("a", first, 3, at[0]),
        QueuedStream("a", second, 1, at[3]), QueuedStream("b", None, 5, at[2]),  # 7, counted to 5
        QueuedStream("c", c_batch, 4, at[0]),
    ], key=lambda s: (s.tenant_id, s.batch_id or ""))
    assert stream_loads(session, "empty", T0, cap=5) == []


def test_a_streams_next_jobs_come_by_priority_then_slack_then_arrival(session: Session) -> None:
    now = T0 + timedelta(seconds=10)
    plain = _add(session, "a", 2, T0)
    missed = _add(session, "a", 1, T0 + timedelta(seconds=1), deadline_s=2.0)  # passed at `now`
    later = _add(session, "a", 1, T0 + timedelta(seconds=2), deadline_s=3600.0)
    soon = _add(session, "a", 1, T0 + timedelta(seconds=3), deadline_s=60.0)
    urgent = _add(session, "a", 1, T0 + timedelta(seconds=4), priority=-1)
    background = _add(session, "a", 1, T0 + timedelta(seconds=5), priority=5, deadline_s=20.0)
    expected = urgent + soon + later + plain + missed + background

    for n in (1, 3, 8):
        assert most_urgent(session, "documents", "a", None, n, now) == expected[:n]
    assert most_urgent(session, "documents", "a", None, 3, now, by_arrival=True) == (plain + missed)[:3]
    assert most_urgent(session, "documents", "a", "no-such-batch", 3, now) == []


def test_the_merged_reads_give_the_order_a_sort_of_the_whole_stream_gives(session: Session) -> None:
    # Every job kind at two priorities, in an arrival order that puts jobs with a deadline ahead before those
    # that rank by arrival: the n most urgent must match the documented order, for every n.
    now = T0 + timedelta(seconds=100)
    kinds = [(0, 3600.0), (0, 600.0), (1, 3600.0), (0, None), (0, 5.0), (1, None), (1, 5.0), (0, 900.0),
             (0, None), (1, 600.0), (0, 5.0), (0, 1200.0)]
    ids = [_add(session, "a", 1, T0 + timedelta(seconds=i), priority=priority, deadline_s=deadline_s)[0]
           for i, (priority, deadline_s) in enumerate(kinds)]

    def rank(i: int) -> tuple[int, bool, float, int]:
        priority, deadline_s = kinds[i]
        ahead = deadline_s is not None and i + deadline_s > 100  # deadline = arrival (i s) + deadline_s
        return priority, not ahead, i + deadline_s if ahead and deadline_s else 0.0, i

    expected = [ids[i] for i in sorted(range(len(kinds)), key=rank)]
    for n in range(1, len(kinds) + 1):
        assert most_urgent(session, "documents", "a", None, n, now) == expected[:n], n
