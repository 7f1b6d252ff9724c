"""Database connections and sessions: SQLite (WAL, busy timeout, one writer at a time) for embedded mode,
Postgres via psycopg otherwise. SQLAlchemy calls a connection pool an "engine"; here it is a db engine, never
to be confused with the inference engine."""

from __future__ import annotations

import threading
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

SQLITE_BUSY_TIMEOUT_MS = 30_000
# Embedded mode's threads (the API's thread pool, the worker's) each hold a connection briefly; a pool
# smaller than that closes and reopens them (and reruns the pragmas) under load.
SQLITE_POOL_SIZE = 48
_WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE")
_HOLDS_WRITE_LOCK = "conveyor_holds_write_lock"  # in a pooled connection's info dict


def make_db_engine(url: str, **kwargs: Any) -> Engine:
    """`postgresql://` URLs use psycopg 3; SQLite files get WAL and a busy timeout on every connection."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() != "sqlite":
        return create_engine(parsed, pool_pre_ping=True, **kwargs)
    if parsed.database not in (None, "", ":memory:"):  # a file: a QueuePool
        kwargs = {"pool_size": SQLITE_POOL_SIZE, "max_overflow": SQLITE_POOL_SIZE, **kwargs}
    db_engine = create_engine(parsed, connect_args={"check_same_thread": False, "timeout": 30}, **kwargs)
    event.listen(db_engine, "connect", _sqlite_pragmas)
    _WriterQueue(threading.Lock()).install(db_engine)
    return db_engine


def make_session_factory(db_engine: Engine) -> sessionmaker[Session]:
    # expire_on_commit=False: transitions commit, and callers keep reading the rows they got back.
    return sessionmaker(bind=db_engine, expire_on_commit=False)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


class _WriterQueue:
    """One SQLite writer at a time in this process, waiting in line on a lock.

    SQLite allows one write transaction at a time, and a connection that finds the write lock taken sleeps
    and retries (its busy handler sleeps 1, 2, 5, ... up to 100 ms), so under concurrent writes from the API
    threads and the worker most of a submit's latency was sleeping. Here a write transaction takes this
    lock before its first write statement (where the sqlite3 driver opens the transaction) and gives it
    back at commit or rollback: waiting writers wake the moment it is free. Reads never wait (WAL)."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock

    def install(self, db_engine: Engine) -> None:
        event.listen(db_engine, "before_cursor_execute", self._before_execute)
        event.listen(db_engine, "commit", self._release)
        event.listen(db_engine, "rollback", self._release)
        event.listen(db_engine.pool, "checkin", self._release_record)

    def _before_execute(self, conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if conn.info.get(_HOLDS_WRITE_LOCK) or not statement.lstrip()[:7].upper().startswith(_WRITES):
            return
        if not self._lock.acquire(timeout=SQLITE_BUSY_TIMEOUT_MS / 1000):
            raise TimeoutError("database is locked: another write transaction held it too long")
        conn.info[_HOLDS_WRITE_LOCK] = True

    def _release(self, conn: Any) -> None:
        self._release_info(conn.info)

    def _release_record(self, _dbapi_connection: Any, record: Any) -> None:
        self._release_info(record.info)  # a connection returned without commit or rollback

    def _release_info(self, info: dict[str, Any]) -> None:
        if info.pop(_HOLDS_WRITE_LOCK, False):
            self._lock.release()


def ping(session: Session) -> None:
    """The cheapest round trip (/readyz)."""
    session.execute(text("SELECT 1"))
