"""A batch's window is refilled by chunks of at least half of it (worker/batches/pacing.py), so a chunk's
fixed costs are shared by many lines: the pace's arithmetic, then a runner on SQLite over a local input whose
jobs are completed in the store as a worker would (no engine), reading only once the room is there."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.clock import utcnow
from conveyor.core.settings import Settings
from conveyor.core.store import batches, jobs
from conveyor.core.store.database import make_db_engine, make_session_factory
from conveyor.core.store.tables import Batch, BatchLine
from conveyor.worker.batches.pacing import MIN_WAIT_S, WAIT_MARGIN, RefillPace
from conveyor.worker.batches.runner import BatchRunner

INTERVAL_S, LONGEST_S = 0.1, 1.0


def test_a_chunk_is_read_once_half_the_window_has_room() -> None:
    pace = RefillPace(window=64, chunk_lines=500)
    assert pace.refill == 32
    assert not pace.ready(active=33) and pace.ready(active=32) and pace.room(active=32) == 32
    assert RefillPace(window=64, chunk_lines=10).refill == 10  # never more than a chunk
    assert RefillPace(window=1, chunk_lines=500).refill == 1  # never less than a line
    with pytest.raises(ValueError, match="window"):
        RefillPace(window=0, chunk_lines=500)


def test_the_wait_is_timed_by_the_pace_lines_end_at() -> None:
    pace = RefillPace(window=64, chunk_lines=500)
    def wait_s(active: int, at_s: float, longest_s: float = LONGEST_S) -> float:
        return pace.wait_s("b", active=active, at_s=at_s, interval_s=INTERVAL_S, longest_s=longest_s)

    assert wait_s(active=64, at_s=0.0) == INTERVAL_S  # nothing known
    pace.read("b", active=0, added=64, at_s=10.0)
    assert wait_s(active=64, at_s=10.0) == INTERVAL_S  # no pace yet
    # 16 lines ended in 0.1 s: 160 lines/s; 16 more must end before 32 have room.
    assert wait_s(active=48, at_s=10.1) == pytest.approx(0.1 * WAIT_MARGIN)
    # The next chunk keeps that pace: right after it, its full window waits 32 lines at 160 lines/s, longer
    # than an interval.
    pace.read("b", active=32, added=32, at_s=10.2)  # 32 ended in 0.2 s
    assert wait_s(active=64, at_s=10.2) == pytest.approx(0.2 * WAIT_MARGIN)
    assert 0.2 * WAIT_MARGIN > INTERVAL_S
    assert wait_s(active=33, at_s=10.3) == MIN_WAIT_S  # one line to go
    assert wait_s(active=64, at_s=10.2, longest_s=0.05) == 0.05  # never past the longest wait
    pace.forget("b")
    assert wait_s(active=64, at_s=10.2) == INTERVAL_S


@pytest.fixture
def sessions(migrated_sqlite_url: str) -> sessionmaker[Session]:
    return make_session_factory(make_db_engine(migrated_sqlite_url))


def _runner(sessions: sessionmaker[Session], make_settings: Callable[..., Settings], window: int,
            ) -> BatchRunner:
    settings = make_settings(database_url=str(sessions.kw["bind"].url), auth_enabled=False,
                             batch_window_jobs=window)
    return BatchRunner(sessions, settings, lambda job_id, queue: None, "runner-r", tokenizer=None, s3=None,
                       interval_s=INTERVAL_S)


def _batch(sessions: sessionmaker[Session], tmp_path: Path, lines: int) -> str:
    path = tmp_path / "in.jsonl"
    rows = ({"custom_id": f"c-{i}", "body": {"prompt": f"p {i}", "max_tokens": 1}} for i in range(lines))
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with sessions() as session:
        return batches.create(session, tenant_id="default", input_url=str(path), output_url=None,
                              queue="documents", now=utcnow()).id


def _complete(sessions: sessionmaker[Session], batch_id: str, n: int) -> None:
    """Plays the worker for the batch's first `n` queued jobs."""
    with sessions() as session:
        ids = list(session.execute(
            select(BatchLine.job_id).where(BatchLine.batch_id == batch_id, BatchLine.status == "queued")
            .order_by(BatchLine.line).limit(n)).scalars())
    assert len(ids) == n
    for job_id in ids:
        with sessions() as session:
            job = jobs.claim(session, str(job_id), "worker-test", utcnow())
            assert job is not None
            assert jobs.complete(session, job.id, job.attempts, result_text="ok", finish_reason="stop",
                                 prompt_tokens=2, completion_tokens=1, preemptions=0, first_token_at=None,
                                 now=utcnow())


def _read(sessions: sessionmaker[Session], batch_id: str) -> tuple[int, int]:
    """(lines read, lines queued or running)."""
    with sessions() as session:
        batch = session.get(Batch, batch_id)
        assert batch is not None
        return batch.read_line - 1, batches.active_lines(session, batch_id)


def test_the_runner_refills_a_window_by_half_of_it_at_least(
    sessions: sessionmaker[Session], make_settings: Callable[..., Settings], tmp_path: Path,
) -> None:
    runner = _runner(sessions, make_settings, window=8)
    batch_id = _batch(sessions, tmp_path, lines=20)

    assert not runner.run_once()  # a full window read; the next round waits for room
    assert _read(sessions, batch_id) == (8, 8)
    _complete(sessions, batch_id, 3)
    assert not runner.run_once()
    assert _read(sessions, batch_id) == (8, 5)  # room for 3 lines: not worth a chunk yet
    _complete(sessions, batch_id, 1)
    runner.run_once()
    assert _read(sessions, batch_id) == (12, 8)  # room for 4: read
    _complete(sessions, batch_id, 8)
    runner.run_once()
    assert _read(sessions, batch_id) == (20, 8)  # the rest, and the input is done

    _complete(sessions, batch_id, 8)
    while runner.run_once():  # finalizing, then closed
        pass
    with sessions() as session:
        batch = batches.get(session, batch_id)
    assert batch is not None and batch.status == "completed" and batch.completed == 20
