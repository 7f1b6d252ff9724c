"""Sessions on a database connection that each thread keeps between its transactions: for the worker's
per-job paths (its claims, its outcome writer), which run one short transaction after another.

A session of the plain factory takes its connection from the pool at its start and gives it back at its end
(the pool's checkout and checkin, and a new Connection each time: about a sixth of what a one-statement
transaction costs the worker on PostgreSQL). A thread that keeps its connection pays neither. One that sat
unused for HOLD_S is pinged before use, as the pool pings an idle one (core/store/database.py), so a
connection that died while idle (a database restart) is replaced before use; one that fails in use is
dropped (the caller sees the error, as before) and the next transaction takes a fresh one.

The factories it wraps are the service's (`make_session_factory`: a sessionmaker bound to a db engine); any
other callable that makes sessions (a test's stand-in) is used as it is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session, sessionmaker

HOLD_S = 1.0  # a held connection unused for this long is pinged before its next use

SessionFactory = Callable[[], AbstractContextManager[Session]]  # a sessionmaker, or HeldSessions


class HeldSessions:
    """Callable as a sessionmaker is (`with held() as session:`), each session on the calling thread's held
    connection. Thread-safe: each thread holds its own connection."""

    def __init__(self, sessions: Callable[..., Session], *, hold_s: float = HOLD_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._sessions = sessions
        bind = sessions.kw.get("bind") if isinstance(sessions, sessionmaker) else None
        self._db_engine = bind if isinstance(bind, Engine) else None  # None: `sessions` used as it is
        self._hold_s = hold_s
        self._clock = clock
        self._local = threading.local()  # .connection and .used_at of this thread
        self._lock = threading.Lock()
        self._held: set[Connection] = set()  # every thread's, for release()

    @contextmanager
    def __call__(self) -> Iterator[Session]:
        if self._db_engine is None:
            with self._sessions() as session:
                yield session
            return
        connection = self._take(self._db_engine)
        try:
            with self._sessions(bind=connection) as session:
                yield session
        finally:
            if connection.invalidated:  # it failed in use: the next transaction takes a fresh one
                self._drop(connection)
            self._local.used_at = self._clock()

    def release(self) -> None:
        """Gives every held connection not in a transaction back to the pool (at shutdown, when the threads
        that held them are done)."""
        with self._lock:
            idle = [connection for connection in self._held if not connection.in_transaction()]
        for connection in idle:
            self._drop(connection)

    def _take(self, db_engine: Engine) -> Connection:
        connection: Connection | None = getattr(self._local, "connection", None)
        if connection is not None and (connection.closed or connection.invalidated or (
                self._clock() - self._local.used_at >= self._hold_s and not _alive(db_engine, connection))):
            self._drop(connection)
            connection = None
        if connection is None:
            connection = db_engine.connect()
            with self._lock:
                self._held.add(connection)
            self._local.connection = connection
        return connection

    def _drop(self, connection: Connection) -> None:
        with self._lock:
            self._held.discard(connection)
        if getattr(self._local, "connection", None) is connection:
            self._local.connection = None
        connection.close()



def _alive(db_engine: Engine, connection: Connection) -> bool:
    """Whether a held connection answers a ping (one that does not is invalidated: its DBAPI connection is
    discarded, not given back to the pool)."""
    try:
        db_engine.dialect.do_ping(connection.connection.dbapi_connection)
    except db_engine.dialect.loaded_dbapi.Error:
        connection.invalidate()
        return False
    return True
