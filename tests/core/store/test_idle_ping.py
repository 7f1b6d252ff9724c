"""PostgreSQL connections are pinged before use only after sitting idle (core/store/database.py
`_ping_when_idle`): one that died while idle is replaced before use, one given back a moment ago is used as
it is, with no round trip."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, text

from conveyor.core.store import database
from conveyor.core.store.database import make_db_engine


@pytest.fixture
def db_engine(postgres_url: str) -> Iterator[Engine]:
    engine = make_db_engine(postgres_url, pool_size=1, max_overflow=0)
    yield engine
    engine.dispose()


@pytest.fixture
def pings(db_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Each ping the pool makes, recorded (and then made)."""
    made: list[Any] = []
    ping = db_engine.dialect.do_ping

    def recorded(dbapi_connection: Any) -> bool:
        made.append(dbapi_connection)
        return ping(dbapi_connection)

    monkeypatch.setattr(db_engine.dialect, "do_ping", recorded)
    return made


def backend_pid(db_engine: Engine) -> int:
    with db_engine.connect() as connection:
        return int(connection.execute(text("SELECT pg_backend_pid()")).scalar_one())


def test_a_connection_given_back_a_moment_ago_is_not_pinged(db_engine: Engine, pings: list[Any]) -> None:
    first = backend_pid(db_engine)
    assert [backend_pid(db_engine) for _ in range(5)] == [first] * 5
    assert pings == []


def test_an_idle_connection_is_pinged_and_one_that_died_is_replaced_before_use(
    db_engine: Engine, pings: list[Any], postgres_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    dead = backend_pid(db_engine)
    admin = postgres_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(admin, autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", (dead,))
    monkeypatch.setattr(database, "PING_IDLE_S", 0.0)  # every connection given back counts as idle
    assert backend_pid(db_engine) != dead  # no error: the dead one was found by its ping and replaced
    assert len(pings) == 1
    backend_pid(db_engine)
    assert len(pings) == 2  # idle again (PING_IDLE_S 0): pinged again, and alive
