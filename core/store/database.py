"""Database connections and sessions: SQLite (WAL, busy timeout, one writer at a time) for embedded mode,
Postgres via psycopg otherwise. SQLAlchemy calls a connection pool an "engine"; here it is a db engine, never
to be confused with the inference engine."""

from __future__ import annotations

import sqlite3
import threading
import time
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import Session, sessionmaker

SQLITE_BUSY_TIMEOUT_MS = 30_000
# Embedded mode's threads (the API's thread pool, the worker's) each hold a connection briefly; a pool
# smaller than that closes and reopens them (and reruns the pragmas) under load.
SQLITE_POOL_SIZE = 48
# A PostgreSQL connection costs the server a backend process, so fewer; but at SQLAlchemy's default (5, and
# 10 more closed again after each use) an API under load reconnected for a third of its submits.
POSTGRES_POOL_SIZE = 16
POSTGRES_NAME_MAX = 63
PING_IDLE_S = 1.0  # a pooled PostgreSQL connection idle this long is pinged before use
_WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE")


def make_db_engine(url: str, *, session_name: str | None = None, **kwargs: Any) -> Engine:
    """`postgresql://` URLs use psycopg 3; SQLite files get WAL and a busy timeout on every connection.
    `session_name`: the Postgres `application_name` of every connection (a worker's id, see
    `postgres_session_name`), so the fleet can find a dead worker's sessions; SQLite ignores it."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() != "sqlite":
        if session_name is not None:
            kwargs["connect_args"] = {**kwargs.get("connect_args", {}),
                                      "application_name": postgres_session_name(session_name)}
        kwargs = {"pool_size": POSTGRES_POOL_SIZE, "max_overflow": POSTGRES_POOL_SIZE, **kwargs}
        db_engine = create_engine(parsed, **kwargs)
        event.listen(db_engine, "connect", _postgres_settings)
        _ping_when_idle(db_engine)
        return db_engine
    if parsed.database not in (None, "", ":memory:"):  # a file: a QueuePool
        kwargs = {"pool_size": SQLITE_POOL_SIZE, "max_overflow": SQLITE_POOL_SIZE, **kwargs}
    writers = _WriterQueue(threading.Lock())
    connect_args = {"check_same_thread": False, "timeout": 30, "factory": writers.connection_class()}
    db_engine = create_engine(parsed, connect_args=connect_args, **kwargs)
    event.listen(db_engine, "connect", _sqlite_pragmas)
    writers.install(db_engine)
    return db_engine


def postgres_session_name(name: str) -> str:
    """`name` as Postgres keeps it in `application_name`: cut to NAMEDATALEN - 1 bytes (ids are ASCII)."""
    return name[:POSTGRES_NAME_MAX]


def make_session_factory(db_engine: Engine) -> sessionmaker[Session]:
    # expire_on_commit=False: transitions commit, and callers keep reading the rows they got back.
    return sessionmaker(bind=db_engine, expire_on_commit=False)


def _postgres_settings(dbapi_connection: Any, _record: Any) -> None:
    """JIT off for this session: the service runs short statements, and PostgreSQL judges JIT worth it by
    the planner's cost, which a correlated subquery per row inflates (the fair claim's skip scan of the
    backlog: 0.1 s of work, 0.7 s of JIT compiling at 20k queued). A session setting, committed, so that no
    rollback undoes it; through a pooler that drops session settings, only JIT comes back."""
    dbapi_connection.execute("SET jit = off")
    dbapi_connection.commit()


def _ping_when_idle(db_engine: Engine) -> None:
    """Pings a pooled PostgreSQL connection before use only when it sat idle for PING_IDLE_S or more: one
    that died while idle (a database restart, a proxy's idle timeout) is replaced before use, as
    `pool_pre_ping` would replace it, but a connection given back a moment ago is not pinged again. (Pinging
    at every checkout was a round trip per transaction: with a submit, a read or a claim each one short
    transaction, a large share of the API's and the worker's time on PostgreSQL.) A connection that died
    within PING_IDLE_S fails its statement instead; the pool is then invalidated, as on any disconnect."""
    dialect = db_engine.dialect

    def checked_in(_dbapi_connection: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    def checked_out(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        idle_since = record.info.pop("idle_since", None)
        if idle_since is None or time.monotonic() - idle_since < PING_IDLE_S:  # fresh, or just used
            return
        try:
            dialect.do_ping(dbapi_connection)
        except dialect.loaded_dbapi.Error as exc:
            if dialect.is_disconnect(exc, dbapi_connection, None):
                raise DisconnectionError(str(exc)) from exc  # the pool reconnects and checks out again
            raise

    event.listen(db_engine, "checkin", checked_in)
    event.listen(db_engine, "checkout", checked_out)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


class _WriterQueue:
    """One SQLite writer at a time per db engine, waiting in line on a lock (embedded mode runs its API and
    its worker on one db engine).

    SQLite allows one write transaction at a time, and a connection that finds the write lock taken sleeps
    and retries (its busy handler sleeps 1, 2, 5, ... up to 100 ms), so under concurrent writes from the API
    threads and the worker most of a submit's latency was sleeping. Here a transaction takes this lock
    before its first write statement (where the sqlite3 driver opens the transaction), and its connection
    gives it back once SQLite's own commit or rollback is done: waiting writers wake the moment SQLite is
    free. Reads never wait (WAL)."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock

    def install(self, db_engine: Engine) -> None:
        event.listen(db_engine, "before_cursor_execute", self._before_execute)

    def connection_class(self) -> type[sqlite3.Connection]:
        """The sqlite3 connection class to connect with: it gives the lock back after commit and rollback."""
        lock = self._lock

        class QueuedConnection(sqlite3.Connection):
            holds_write_lock = False

            def commit(self) -> None:
                try:
                    super().commit()
                finally:
                    self.give_back()

            def rollback(self) -> None:
                try:
                    super().rollback()
                finally:
                    self.give_back()

            def close(self) -> None:
                try:
                    super().close()
                finally:
                    self.give_back()

            def give_back(self) -> None:
                if self.holds_write_lock:
                    self.holds_write_lock = False
                    lock.release()

        return QueuedConnection

    def _before_execute(self, _conn: Any, cursor: Any, statement: str, *_args: Any) -> None:
        connection = cursor.connection
        if connection.holds_write_lock or not statement.lstrip()[:7].upper().startswith(_WRITES):
            return
        if not self._lock.acquire(timeout=SQLITE_BUSY_TIMEOUT_MS / 1000):
            # What SQLite itself raises when its busy timeout runs out (callers retry OperationalError).
            raise sqlite3.OperationalError("database is locked: another write transaction held it too long")
        connection.holds_write_lock = True


def ping(session: Session) -> None:
    """The cheapest round trip (/readyz)."""
    session.execute(text("SELECT 1"))
