"""A broker restart's republish on Postgres (core/store/republish_walk.py, worker/reconciler.py rule 5):
every queued job dispatched before the broker lost its queues goes out again, lane by lane, oldest first,
once, with no UPDATE of a job row; a batch per transaction and a bounded time per round; any reconciler
carries the walk on from the cursor in the store, one at a time; a second loss starts it over."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import event, select
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.clock import utcnow
from conveyor.core.store import jobs, republish_walk
from conveyor.core.store.tables import BrokerRepublish, Job
from conveyor.worker import reconciler as reconciler_module
from conveyor.worker.reconciler import Reconciler
from tests.support.service import RecordingPublisher
from tests.support.worker import add_job, lane

BATCH = 2


@pytest.fixture(autouse=True)
def one_small_batch_per_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of BATCH jobs, and a round's time spent after its first batch: each round publishes one."""
    monkeypatch.setattr(reconciler_module, "REDISPATCH_BATCH", BATCH)
    monkeypatch.setattr(reconciler_module, "REPUBLISH_ROUND_S", 0.0)


def _dispatched_long_ago(sessions: sessionmaker[Session], queue: str, n: int) -> list[str]:
    """n queued jobs of `queue`, dispatched a minute ago, a second apart, oldest first."""
    job_ids = [add_job(sessions, f"{queue} {i}", queue) for i in range(n)]
    with sessions() as session:
        for i, job_id in enumerate(job_ids):
            jobs.mark_dispatched(session, [job_id], utcnow() - timedelta(seconds=60 - i))
    return job_ids


def _dispatch_times(sessions: sessionmaker[Session]) -> dict[str, datetime | None]:
    with sessions() as session:
        return {job_id: at for job_id, at in session.execute(select(Job.id, Job.dispatched_at))}


@contextmanager
def _job_rows_updated(sessions: sessionmaker[Session]) -> Iterator[list[int]]:
    """The rows each UPDATE of jobs changes meanwhile (a round's sweeps run theirs, changing none here)."""
    counts: list[int] = []

    def record(_conn: Any, cursor: Any, statement: str, *_args: Any) -> None:
        if re.match(r"\s*UPDATE jobs\b", statement):
            counts.append(cursor.rowcount)

    bind = sessions.kw["bind"]
    event.listen(bind, "after_cursor_execute", record)
    try:
        yield counts
    finally:
        event.remove(bind, "after_cursor_execute", record)


def test_every_queued_job_goes_out_again_lane_by_lane_oldest_first_once_without_a_job_update(
    sessions: sessionmaker[Session], make_settings: Callable[..., Any], pg_url: str
) -> None:
    settings = make_settings(database_url=pg_url, dispatch_grace_s=5.0)
    documents = _dispatched_long_ago(sessions, "documents", 3)
    interactive = _dispatched_long_ago(sessions, "interactive", 2)
    add_job(sessions, "not published yet")  # undispatched, within the API's grace: not the walk's
    broker = RecordingPublisher()
    broker.waiting = 50  # a busy queue: the empty-queue rule would never fire
    reconciler = Reconciler(sessions, broker, settings)
    before = _dispatch_times(sessions)

    broker.restarted = True  # Redis came back without its data
    with _job_rows_updated(sessions) as updated:
        rounds = [reconciler.run_once().redispatched for _ in range(5)]

    assert rounds == [2, 1, 2, 0, 0]  # a batch a round; a lane's short batch ends it
    assert sorted(settings.lanes()) == [lane("documents"), lane("interactive")]
    expected = [(job_id, lane("documents")) for job_id in documents]
    assert broker.published == expected + [(job_id, lane("interactive")) for job_id in interactive]
    assert _dispatch_times(sessions) == before  # no job row was written
    assert updated and not any(updated)
    with sessions() as session:
        row = session.get(BrokerRepublish, republish_walk.ROW_ID)
        assert row is not None and (row.lost_before, row.published, row.generation) == (None, 5, 1)


def test_another_reconciler_carries_the_walk_on_from_its_cursor(
    sessions: sessionmaker[Session], make_settings: Callable[..., Any], pg_url: str
) -> None:
    """The reconciler that was told the broker lost its queues may die after its first batch: the others,
    never told, go on from where it stopped."""
    settings = make_settings(database_url=pg_url)
    backlog = _dispatched_long_ago(sessions, "interactive", 5)
    told, other = RecordingPublisher(), RecordingPublisher()
    told.restarted, told.waiting, other.waiting = True, 50, 50
    assert Reconciler(sessions, told, settings).run_once().redispatched == 2

    carrying_on = Reconciler(sessions, other, settings)
    assert [carrying_on.run_once().redispatched for _ in range(3)] == [2, 1, 0]
    assert told.published + other.published == [(job_id, lane("interactive")) for job_id in backlog]


def test_a_walk_one_reconciler_holds_is_passed_over_by_the_others_without_waiting(
    sessions: sessionmaker[Session], make_settings: Callable[..., Any], pg_url: str
) -> None:
    settings = make_settings(database_url=pg_url)
    _dispatched_long_ago(sessions, "interactive", 3)
    with sessions() as session:
        republish_walk.begin(session, utcnow(), settings.lanes())
    broker = RecordingPublisher()
    broker.waiting = 50
    with sessions() as holder:
        assert republish_walk.take(holder) is not None  # another reconciler is publishing its batch
        assert Reconciler(sessions, broker, settings).run_once().redispatched == 0
    assert broker.published == []
    assert Reconciler(sessions, broker, settings).run_once().redispatched == 2  # its turn, once freed


def test_the_broker_losing_its_queues_again_mid_walk_starts_it_over(
    sessions: sessionmaker[Session], make_settings: Callable[..., Any], pg_url: str
) -> None:
    settings = make_settings(database_url=pg_url)
    backlog = _dispatched_long_ago(sessions, "interactive", 3)
    broker = RecordingPublisher()
    broker.waiting = 50
    reconciler = Reconciler(sessions, broker, settings)
    broker.restarted = True
    assert reconciler.run_once().redispatched == 2
    broker.restarted = True  # lost again: what went out in the first walk is gone too
    assert [reconciler.run_once().redispatched for _ in range(3)] == [2, 1, 0]
    sent = [job_id for job_id, _ in broker.published]
    assert sent == backlog[:2] + backlog
    with sessions() as session:
        row = session.get(BrokerRepublish, republish_walk.ROW_ID)
        assert row is not None and (row.generation, row.published) == (2, 3)


def test_jobs_dispatched_after_the_loss_are_not_the_walks(
    sessions: sessionmaker[Session], make_settings: Callable[..., Any], pg_url: str
) -> None:
    """A job published once the broker was back keeps its message: the walk stops at `lost_before`."""
    settings = make_settings(database_url=pg_url)
    old = _dispatched_long_ago(sessions, "interactive", 1)
    new = add_job(sessions, "published after the restart")
    with sessions() as session:
        republish_walk.begin(session, utcnow(), settings.lanes())
        jobs.mark_dispatched(session, [new], utcnow() + timedelta(seconds=1))
    broker = RecordingPublisher()
    broker.waiting = 50
    assert Reconciler(sessions, broker, settings).run_once().redispatched == 1
    assert broker.published == [(old[0], lane("interactive"))]


def test_a_loss_the_store_could_not_record_is_recorded_next_round(
    sessions: sessionmaker[Session], make_settings: Callable[..., Any], pg_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """lost_messages() says so once: a round whose store write failed keeps the news for the next."""
    settings = make_settings(database_url=pg_url)
    backlog = _dispatched_long_ago(sessions, "interactive", 1)
    broker = RecordingPublisher()
    broker.waiting, broker.restarted = 50, True
    reconciler = Reconciler(sessions, broker, settings)
    begin = republish_walk.begin

    def store_down(*_args: Any) -> int:
        raise ConnectionError("store: gone")

    monkeypatch.setattr(republish_walk, "begin", store_down)
    with pytest.raises(ConnectionError):
        reconciler.run_once()
    monkeypatch.setattr(republish_walk, "begin", begin)
    assert reconciler.run_once().redispatched == 1
    assert broker.published == [(backlog[0], lane("interactive"))]
