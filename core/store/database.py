"""Database connections and sessions: SQLite (WAL, busy timeout) for embedded mode, Postgres via psycopg
otherwise. SQLAlchemy calls a connection pool an "engine"; here it is a db engine, never to be confused with
the inference engine."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

SQLITE_BUSY_TIMEOUT_MS = 30_000


def make_db_engine(url: str, **kwargs: Any) -> Engine:
    """`postgresql://` URLs use psycopg 3; SQLite files get WAL and a busy timeout on every connection."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() != "sqlite":
        return create_engine(parsed, pool_pre_ping=True, **kwargs)
    db_engine = create_engine(parsed, connect_args={"check_same_thread": False, "timeout": 30}, **kwargs)
    event.listen(db_engine, "connect", _sqlite_pragmas)
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


def ping(session: Session) -> None:
    """The cheapest round trip (/readyz)."""
    session.execute(text("SELECT 1"))
