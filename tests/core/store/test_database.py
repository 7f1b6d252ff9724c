"""SQLite's writer queue (core/store/database.py `_WriterQueue`): writers of this process wait in line on a
lock taken before a transaction's first write and given back at commit, rollback or connection checkin;
reads never take it. SQLite only: Postgres has no such lock."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timezone

import pytest
from sqlalchemy import Engine, event, func, insert, select, update
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.store import database, jobs
from conveyor.core.store.database import make_db_engine, make_session_factory
from conveyor.core.store.tables import DEFAULT_TENANT, Job

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
JOIN_S = 10.0  # far longer than any write here takes, far shorter than the lock's 30 s timeout


@pytest.fixture
def db_engine(migrated_sqlite_url: str) -> Iterator[Engine]:
    engine = make_db_engine(migrated_sqlite_url)
    yield engine
    engine.dispose()


@pytest.fixture
def sessions(db_engine: Engine) -> sessionmaker[Session]:
    return make_session_factory(db_engine)


def new_job(key: str | None = None) -> jobs.NewJob:
    return jobs.NewJob(
        tenant_id=DEFAULT_TENANT, queue="interactive", prompt="hello", messages=None, params={}, meta=None,
        webhook=None, idempotency_key=key, request_hash="h", prompt_tokens=1, ttl_s=None, timeout_s=None,
    )


def count_jobs(sessions: sessionmaker[Session]) -> int:
    with sessions() as session:
        return int(session.execute(select(func.count()).select_from(Job)).scalar_one())


def in_thread(work: Callable[[], object]) -> tuple[threading.Thread, list[BaseException]]:
    """Starts `work` in a thread; the list gets what it raised."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def finishes(work: Callable[[], object]) -> bool:
    """Whether `work`, run in another thread, ends cleanly within JOIN_S (a leaked lock makes it wait)."""
    thread, errors = in_thread(work)
    thread.join(JOIN_S)
    if errors:
        raise errors[0]
    return not thread.is_alive()


def add_one(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        jobs.add(session, new_job(), T0)


def test_concurrent_writers_in_separate_sessions_all_succeed(sessions: sessionmaker[Session]) -> None:
    threads, per_thread = 8, 25

    def writer() -> None:
        for _ in range(per_thread):
            add_one(sessions)

    started = [in_thread(writer) for _ in range(threads)]
    for thread, _ in started:
        thread.join(120)
    assert [error for _, errors in started for error in errors] == []
    assert not any(thread.is_alive() for thread, _ in started)
    assert count_jobs(sessions) == threads * per_thread


def test_a_failed_write_releases_the_lock_at_rollback(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        jobs.add(session, new_job("same-key"), T0)
        with pytest.raises(IntegrityError):
            jobs.add(session, new_job("same-key"), T0)
        session.rollback()  # as api/submit.py does before it reads the earlier job
        assert finishes(lambda: add_one(sessions))
    assert count_jobs(sessions) == 2


def test_a_connection_rolled_back_but_still_open_holds_no_lock(
    db_engine: Engine, sessions: sessionmaker[Session],
) -> None:
    with db_engine.connect() as conn:
        conn.execute(update(Job).values(queue="documents"))
        conn.rollback()
        assert finishes(lambda: add_one(sessions))  # while `conn` is still checked out


def test_a_session_closed_without_commit_after_a_write_releases_the_lock(
    sessions: sessionmaker[Session],
) -> None:
    session = sessions()
    session.execute(insert(Job), [_row("job_uncommitted")])
    session.close()
    assert finishes(lambda: add_one(sessions))
    assert count_jobs(sessions) == 1  # the closed session's insert was rolled back


def test_reads_do_not_wait_for_an_open_write_transaction(sessions: sessionmaker[Session]) -> None:
    add_one(sessions)
    with sessions() as writer:
        writer.execute(insert(Job), [_row("job_uncommitted")])  # holds the write lock until commit
        assert finishes(lambda: count_jobs(sessions))
        assert count_jobs(sessions) == 1  # WAL: the open transaction's row is not seen yet
        waiting, errors = in_thread(lambda: add_one(sessions))
        waiting.join(0.2)
        assert waiting.is_alive()  # a second writer waits for the first one's commit
        writer.commit()
    waiting.join(JOIN_S)
    assert not waiting.is_alive() and errors == []
    assert count_jobs(sessions) == 3


def test_only_a_write_statement_takes_the_lock_and_commit_gives_it_back(
    sessions: sessionmaker[Session],
) -> None:
    with sessions() as session:
        dbapi = session.connection().connection.dbapi_connection  # the sqlite3 connection itself
        session.execute(select(Job.id)).all()
        assert not dbapi.holds_write_lock  # type: ignore[union-attr]
        session.execute(insert(Job), [_row("job_1")])
        assert dbapi.holds_write_lock  # type: ignore[union-attr]
        session.commit()
        assert not dbapi.holds_write_lock  # type: ignore[union-attr]


def test_a_writer_that_times_out_in_the_queue_gets_the_timeout_and_closes_cleanly(
    sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(database, "SQLITE_BUSY_TIMEOUT_MS", 200)

    def times_out() -> None:
        with sessions() as session, pytest.raises(OperationalError, match="database is locked"):
            jobs.add(session, new_job(), T0)

    with sessions() as holder:
        holder.execute(insert(Job), [_row("job_held")])
        assert finishes(times_out)
        holder.commit()
    assert finishes(lambda: add_one(sessions))
    assert count_jobs(sessions) == 2


def test_the_lock_is_given_back_after_the_commit_itself(db_engine: Engine, sessions: sessionmaker[Session],
                                                        ) -> None:
    holder_thread = threading.current_thread()
    next_writer_reached_sqlite = threading.Event()
    let_through_before_commit: list[bool] = []

    def past_the_queue(_conn: object, _cursor: object, statement: str, *_args: object) -> None:
        another = threading.current_thread() is not holder_thread
        if another and statement.lstrip().upper().startswith("INSERT"):
            next_writer_reached_sqlite.set()

    def committing(_conn: object) -> None:  # after the writer queue's own commit listener, before the commit
        if threading.current_thread() is holder_thread:
            let_through_before_commit.append(next_writer_reached_sqlite.wait(0.2))

    event.listen(db_engine, "before_cursor_execute", past_the_queue)
    event.listen(db_engine, "commit", committing)
    with sessions() as holder:
        holder.execute(insert(Job), [_row("job_held")])
        waiting, errors = in_thread(lambda: add_one(sessions))
        holder.commit()
    waiting.join(JOIN_S)
    assert errors == [] and let_through_before_commit == [False]


def _row(job_id: str) -> dict[str, object]:
    return dict(id=job_id, tenant_id=DEFAULT_TENANT, queue="interactive", status="queued", prompt="x",
                params={}, request_hash="h", created_at=T0, updated_at=T0, attempts=0, preemptions=0)
