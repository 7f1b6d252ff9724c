"""Sessions on a connection each thread keeps (core/store/held_sessions.py): one checkout for a thread's
transactions one after another, a connection of its own per thread, a held connection that sat idle pinged
and replaced before use when it died, one that failed in use dropped, and every one given back at release."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, event, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from conveyor.core.store.database import make_db_engine, make_session_factory
from conveyor.core.store.held_sessions import HOLD_S, HeldSessions


@pytest.fixture
def db_engine(postgres_url: str) -> Iterator[Engine]:
    engine = make_db_engine(postgres_url, pool_size=2, max_overflow=0)
    yield engine
    engine.dispose()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def backend_pid(session: Session) -> int:
    return int(session.execute(text("SELECT pg_backend_pid()")).scalar_one())


def pid_in_transaction(held: HeldSessions) -> int:
    with held() as session:
        pid = backend_pid(session)
        session.commit()
    return pid


def terminate(postgres_url: str, pid: int) -> None:
    admin = postgres_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(admin, autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", (pid,))


def test_a_thread_keeps_one_connection_and_another_thread_has_its_own(db_engine: Engine) -> None:
    checkouts: list[Any] = []
    event.listen(db_engine, "checkout", lambda *args: checkouts.append(args))
    held = HeldSessions(make_session_factory(db_engine))

    mine = {pid_in_transaction(held) for _ in range(5)}
    theirs: list[int] = []
    other = threading.Thread(target=lambda: theirs.append(pid_in_transaction(held)))
    other.start()
    other.join()

    assert len(mine) == 1 and theirs and theirs[0] not in mine
    assert len(checkouts) == 2  # one per thread, not one per transaction
    held.release()
    assert db_engine.pool.checkedout() == 0  # every held connection given back


def test_a_held_connection_that_died_while_idle_is_replaced_before_use(db_engine: Engine,
                                                                        postgres_url: str) -> None:
    clock = Clock()
    held = HeldSessions(make_session_factory(db_engine), clock=clock)
    dead = pid_in_transaction(held)
    terminate(postgres_url, dead)
    clock.now += HOLD_S  # idle that long: pinged before use

    assert pid_in_transaction(held) != dead  # no error: the ping found it dead
    held.release()


def test_a_held_connection_that_fails_in_use_is_dropped_and_the_next_transaction_gets_a_fresh_one(
    db_engine: Engine, postgres_url: str,
) -> None:
    held = HeldSessions(make_session_factory(db_engine), clock=Clock())
    dead = pid_in_transaction(held)
    terminate(postgres_url, dead)  # used a moment ago: not pinged, its statement fails

    with pytest.raises(OperationalError):
        pid_in_transaction(held)
    assert pid_in_transaction(held) != dead
    held.release()


def test_a_factory_that_is_no_bound_sessionmaker_is_used_as_it_is(db_engine: Engine) -> None:
    made: list[Session] = []
    sessions = make_session_factory(db_engine)

    def factory() -> Session:
        made.append(sessions())
        return made[-1]

    held = HeldSessions(factory)
    with held() as session:
        assert session is made[0]
    assert len(made) == 1
