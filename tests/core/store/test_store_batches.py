"""The batch store on SQLite and Postgres: the lease, the fenced chunk commit, and job outcomes counted into
their batch exactly once (through the job transitions' record_finished hook)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import delete, select, text
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.clock import utcnow
from conveyor.core.store import batches, jobs
from conveyor.core.store.batches import ChunkPosition
from conveyor.core.store.tables import Batch, BatchLine, Job


@pytest.fixture(autouse=True)
def _forget_batches(session: Session) -> Iterator[None]:
    """Batches left open in the shared Postgres database would be picked up by later tests' runners."""
    yield
    session.rollback()
    session.execute(delete(BatchLine))
    session.execute(delete(Job).where(Job.batch_id.is_not(None)))  # their batch_id refers to the batches
    session.execute(delete(Batch))
    session.commit()


def _batch(session: Session, tenant: str = "default") -> Batch:
    return batches.create(session, tenant_id=tenant, input_url="s3://bucket-a/in.jsonl",
                          output_url="s3://bucket-a/out/", queue="documents", now=utcnow())


def _job(batch: Batch, line: int) -> dict[str, Any]:
    new = jobs.NewJob(tenant_id=batch.tenant_id, queue="documents", prompt="hi", messages=None,
                      params={"max_tokens": 1}, meta={"batch_id": batch.id, "line": line}, webhook=None,
                      idempotency_key=None, request_hash="batch", prompt_tokens=0, ttl_s=None, timeout_s=None,
                      batch_id=batch.id)
    return jobs.build_row(new, utcnow())


def _chunk(session: Session, batch: Batch, owner: str, start: int, n_jobs: int,
           bad_line: bool = False) -> list[str]:
    """Commits a chunk of `n_jobs` valid lines (and one invalid line after them); their jobs' ids."""
    new_jobs = [_job(batch, start + i) for i in range(n_jobs)]
    lines = [batches.queued_line(batch.id, start + i, f"c-{start + i}", job["id"])
             for i, job in enumerate(new_jobs)]
    if bad_line:
        error = {"code": "invalid_json", "message": "x", "custom_id": None}
        lines.append(batches.failed_line(batch.id, start + n_jobs, None, error))
    end = start + len(lines)
    position = ChunkPosition(start_line=start, next_line=end, next_offset=end * 10, done=False)
    assert batches.commit_chunk(session, batch.id, owner, position, lines, new_jobs, utcnow())
    return [job["id"] for job in new_jobs]


def _run(session: Session, job_id: str, *, ok: bool) -> None:
    claimed = jobs.claim(session, job_id, "w1", utcnow())
    assert claimed is not None
    if ok:
        assert jobs.complete(session, job_id, claimed.attempts, result_text="x", finish_reason="length",
                             prompt_tokens=5, completion_tokens=1, preemptions=0, first_token_at=None,
                             now=utcnow())
    else:
        assert jobs.fail(session, job_id, claimed.attempts, code="engine_error", message="boom", now=utcnow())


def test_outcomes_count_once_and_cancel_counts_the_rest(session: Session) -> None:
    batch = _batch(session)
    assert batches.take_lease(session, batch.id, "runner-1", utcnow(), 30.0)
    first, second, third = _chunk(session, batch, "runner-1", 1, 3, bad_line=True)

    _run(session, first, ok=True)
    _run(session, second, ok=False)
    late = jobs.complete(session, first, 1, result_text="again", finish_reason="stop", prompt_tokens=5,
                         completion_tokens=1, preemptions=0, first_token_at=None, now=utcnow())
    assert late is False  # a duplicate report changes nothing and counts nothing
    assert batches.active_lines(session, batch.id) == 1

    cancelling = batches.request_cancel(session, batch.id, "default", utcnow())
    assert cancelling is not None and cancelling.status == "cancelling"
    row = batches.get(session, batch.id)
    assert row is not None
    assert (row.total, row.completed, row.failed, row.cancelled) == (4, 1, 2, 1)
    assert (row.prompt_tokens, row.completion_tokens) == (5, 1)
    assert jobs.get(session, third).status == "cancelled"  # type: ignore[union-attr]
    assert batches.active_lines(session, batch.id) == 0
    assert [line.line for line, _ in batches.lines_in_order(session, batch.id)] == [1, 2, 3, 4]


def test_the_lease_fences_chunks_and_passes_on_when_it_expires(session: Session) -> None:
    batch = _batch(session)
    now = utcnow()
    assert batches.take_lease(session, batch.id, "runner-1", now, 30.0)
    assert not batches.take_lease(session, batch.id, "runner-2", now, 30.0)
    _chunk(session, batch, "runner-1", 1, 2)
    stale = ChunkPosition(start_line=1, next_line=3, next_offset=30, done=False)  # runner-1's view, replayed
    assert not batches.commit_chunk(session, batch.id, "runner-1", stale, [], [], utcnow())

    later = now + timedelta(seconds=31)
    assert batch.id in batches.claimable(session, "runner-2", later, 100)
    assert batches.take_lease(session, batch.id, "runner-2", later, 30.0)
    fresh = ChunkPosition(start_line=3, next_line=4, next_offset=40, done=True)
    assert not batches.commit_chunk(session, batch.id, "runner-1", fresh, [], [], utcnow())  # lost its lease
    assert batches.commit_chunk(session, batch.id, "runner-2", fresh, [], [], utcnow())
    assert batches.seen_custom_ids(session, batch.id) == {"c-1", "c-2"}
    row = batches.get(session, batch.id)
    assert row is not None and (row.read_line, row.read_offset, row.read_done) == (4, 40, True)


def test_another_tenant_cannot_see_or_cancel(session: Session) -> None:
    batch = _batch(session, tenant="alice")
    assert batches.get(session, batch.id, "bob") is None
    assert batches.request_cancel(session, batch.id, "bob", utcnow()) is None
    assert batches.page(session, "bob", limit=10) == []
    assert batches.get(session, batch.id, "alice").status == "validating"  # type: ignore[union-attr]


def test_pages_after_and_before_a_batch_of_one_endpoint(session: Session) -> None:
    """Newest first (created_at, then id); `after` the page past a batch, `before` the page just newer than
    it, nearest first dropped last; only the tenant's batches of the endpoint asked for."""
    now = utcnow()
    made = [batches.create(session, tenant_id="alice", input_url="s3://bucket-a/in.jsonl", output_url=None,
                           queue="documents", endpoint="/v1/messages", now=now + timedelta(seconds=i // 2))
            for i in range(5)]  # two pairs created at the same instant: the id orders them
    batches.create(session, tenant_id="alice", input_url="s3://bucket-a/in.jsonl", output_url=None,
                   queue="documents", endpoint="/v1/chat/completions", now=now + timedelta(seconds=9))
    newest = [b.id for b in sorted(made, key=lambda b: (b.created_at, b.id), reverse=True)]

    def ids(**cursor: str) -> list[str]:
        page = batches.page(session, "alice", limit=2, endpoint="/v1/messages", **cursor)
        return [b.id for b in page]

    assert ids() == newest[:2] and ids(after=newest[1]) == newest[2:4] and ids(after=newest[3]) == newest[4:]
    assert ids(before=newest[4]) == newest[2:4] and ids(before=newest[1]) == newest[:1]
    assert ids(before=newest[0]) == [] and ids(after="batch_unknown") == ids(before="batch_unknown") == []
    assert len(batches.page(session, "alice", limit=10)) == 6 and batches.page(session, "bob", limit=10) == []


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
def test_a_batch_cancel_locks_its_jobs_in_id_order(session: Session,
                                                   session_factory: sessionmaker[Session]) -> None:
    """A batch cancel locked its jobs in line order while a claim of some of them locked in id order: each
    held a row the other waited on, and PostgreSQL failed the cancel with a deadlock. Holding one job's row
    elsewhere stops the cancel there: the rows it already holds must be exactly those of smaller id."""
    batch = _batch(session)
    assert batches.take_lease(session, batch.id, "runner-1", utcnow(), 30.0)
    chunk = _chunk(session, batch, "runner-1", 1, 20)
    by_id = sorted(chunk)
    in_line_order = list(chunk)
    held = next(job_id for job_id in by_id[5:] if in_line_order.index(job_id) != by_id.index(job_id))
    holder = session_factory()
    holder.execute(select(Job.id).where(Job.id == held).with_for_update())

    cancelled: list[str] = []
    canceller = threading.Thread(target=lambda: cancelled.extend(_cancel_jobs(session_factory, batch.id)))
    canceller.start()
    try:
        _wait_until_blocked(session_factory)
        with session_factory() as peer:
            free = peer.execute(select(Job.id).where(Job.id.in_(by_id)).with_for_update(skip_locked=True))
            assert sorted(free.scalars()) == [job_id for job_id in by_id if job_id > held]
            peer.rollback()
    finally:
        holder.rollback()
        holder.close()
        canceller.join(timeout=30)
    assert sorted(cancelled) == by_id


def _cancel_jobs(sessions: sessionmaker[Session], batch_id: str) -> list[str]:
    with sessions() as session:
        ids = batches.cancel_active_jobs(session, batch_id, utcnow())
        session.commit()
        return ids


# The other thread reaches the lock in milliseconds; a loaded CI machine was seen to need more than 5 s.
BLOCKED_WITHIN_S = 60.0


def _wait_until_blocked(sessions: sessionmaker[Session]) -> None:
    """Until another backend of this database waits for a row lock. Each look is its own transaction:
    PostgreSQL keeps one snapshot of pg_stat_activity for a whole transaction, so a session that looked
    once before the cancel blocked saw it not waiting for as long as it kept looking (a loaded run failed
    so after 60 s)."""
    waiting = text("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                   "AND wait_event_type = 'Lock'")
    deadline = time.monotonic() + BLOCKED_WITHIN_S
    while time.monotonic() < deadline:
        with sessions() as probe:
            if probe.execute(waiting).scalar_one():
                return
        time.sleep(0.05)
    raise AssertionError("the cancel never waited on the held row")


def test_a_scheduled_batch_waits_for_its_time_unless_cancelled(session: Session) -> None:
    now = utcnow()
    batch = batches.create(session, tenant_id="default", input_url="s3://b/in.jsonl", output_url=None,
                           queue="documents", now=now, run_at=now + timedelta(hours=1),
                           completion_window_s=3600.0)
    assert batch.expires_at == now + timedelta(hours=2)  # its window counts from its start
    assert batch.id not in batches.claimable(session, "runner", now, 10)
    assert batch.id in batches.claimable(session, "runner", now + timedelta(hours=1), 10)
    cancelled = batches.request_cancel(session, batch.id, "default", now)
    assert cancelled is not None and cancelled.status == "cancelling"
    assert batch.id in batches.claimable(session, "runner", now, 10)  # its runner closes it at once
