"""The API process's listener for auth notices on PostgreSQL: a revocation or a limit change made by another
session drops the cached entry as soon as it commits (the TTL here is a minute: only the notice can do it);
a rolled-back change sends nothing; a listener whose connection is cut reconnects and forgets everything it
may have missed meanwhile; SQLite and a cache that is off get no listener."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timezone

import psycopg
import pytest
from sqlalchemy import update
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.store import auth_notices, keys, tenants
from conveyor.core.store.auth_cache import AuthCache
from conveyor.core.store.auth_listener import APPLICATION_NAME, AuthListener, listener_for
from conveyor.core.store.database import make_db_engine, make_session_factory
from conveyor.core.store.tables import ApiKey
from conveyor.core.store.tenants import TenantLimits
from tests.support.live_server import wait_for

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
TTL_S = 60.0
HEARD_S = 5.0  # a notice is heard within moments; this only bounds a failing test


@pytest.fixture
def sessions(emptied_postgres: str) -> Iterator[sessionmaker[Session]]:
    db_engine = make_db_engine(emptied_postgres)
    yield make_session_factory(db_engine)
    db_engine.dispose()


@pytest.fixture
def cache() -> AuthCache:
    return AuthCache(TTL_S, TenantLimits())


@pytest.fixture
def listener(emptied_postgres: str, cache: AuthCache) -> Iterator[AuthListener]:
    ear = AuthListener(make_url(emptied_postgres), cache, poll_s=0.1)
    ear.start()
    try:
        wait_for(ear.listening.is_set, "the listener to LISTEN", HEARD_S)
        yield ear
    finally:
        ear.stop()


def _cached_key(sessions: sessionmaker[Session], cache: AuthCache, tenant: str) -> tuple[str, str]:
    """(key id, key hash) of a new key of `tenant`, read into the cache."""
    with sessions() as session:
        row, plaintext = keys.create_key(session, tenant, T0)
        assert cache.grant(session, keys.hash_key(plaintext)) is not None
    return row.id, keys.hash_key(plaintext)


def test_a_revocation_committed_elsewhere_drops_the_key_at_once(
    sessions: sessionmaker[Session], cache: AuthCache, listener: AuthListener,
) -> None:
    key_id, key_hash = _cached_key(sessions, cache, "alice")
    _, kept = _cached_key(sessions, cache, "bob")
    with sessions() as session:
        assert keys.revoke_key(session, key_id, T0)
    wait_for(lambda: cache.cached_grant(key_hash) is None, "the revocation's notice", HEARD_S)
    assert cache.cached_grant(kept) is not None
    with sessions() as session:
        assert cache.grant(session, key_hash) is None


def test_a_limit_change_committed_elsewhere_drops_the_tenants_limits_at_once(
    sessions: sessionmaker[Session], cache: AuthCache, listener: AuthListener,
) -> None:
    with sessions() as session:
        assert cache.limits(session, "alice").max_queued is None
        tenants.set_overrides(session, "alice", {"max_queued": 3}, T0)

    def changed() -> bool:
        with sessions() as session:
            return cache.limits(session, "alice").max_queued == 3

    wait_for(changed, "the limit change's notice", HEARD_S)


def test_a_rolled_back_revocation_sends_nothing(
    sessions: sessionmaker[Session], cache: AuthCache, listener: AuthListener,
) -> None:
    rolled_back_id, rolled_back = _cached_key(sessions, cache, "alice")
    later_id, later = _cached_key(sessions, cache, "bob")
    with sessions() as session:
        session.execute(update(ApiKey).where(ApiKey.id == rolled_back_id).values(revoked_at=T0))
        auth_notices.send(session, auth_notices.key_revoked(rolled_back))
        session.rollback()
        assert keys.revoke_key(session, later_id, T0)
    # Notices arrive in commit order: once the later one is heard, the rolled-back one would have been.
    wait_for(lambda: cache.cached_grant(later) is None, "the later revocation's notice", HEARD_S)
    assert cache.cached_grant(rolled_back) is not None


def test_a_cut_connection_is_reopened_and_what_was_cached_before_is_forgotten(
    emptied_postgres: str, sessions: sessionmaker[Session], cache: AuthCache, listener: AuthListener,
) -> None:
    _, cached_before = _cached_key(sessions, cache, "alice")
    first = _listener_backends(emptied_postgres)
    assert len(first) == 1
    _terminate(emptied_postgres, first[0])
    wait_for(lambda: _listener_backends(emptied_postgres) not in ([], first), "the listener to reconnect",
             HEARD_S * 3)
    wait_for(listener.listening.is_set, "LISTEN again", HEARD_S)
    assert cache.cached_grant(cached_before) is None, "a revocation may have been missed while it was cut"
    key_id, key_hash = _cached_key(sessions, cache, "bob")
    with sessions() as session:
        assert keys.revoke_key(session, key_id, T0)
    wait_for(lambda: cache.cached_grant(key_hash) is None, "a notice on the new connection", HEARD_S)


def test_sqlite_and_a_cache_that_is_off_get_no_listener(migrated_sqlite_url: str,
                                                        emptied_postgres: str) -> None:
    for url, ttl_s, expected in ((migrated_sqlite_url, 1.0, False), (emptied_postgres, 0.0, False),
                                 (emptied_postgres, 1.0, True)):
        db_engine = make_db_engine(url)
        assert (listener_for(db_engine, AuthCache(ttl_s, TenantLimits())) is not None) is expected, url
        db_engine.dispose()


def _admin_dsn(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _listener_backends(url: str) -> list[int]:
    with psycopg.connect(_admin_dsn(url), autocommit=True) as conn:
        query = ("SELECT pid FROM pg_stat_activity WHERE application_name = %s"
                 " AND datname = current_database()")
        return [pid for (pid,) in conn.execute(query, (APPLICATION_NAME,)).fetchall()]


def _terminate(url: str, pid: int) -> None:
    with psycopg.connect(_admin_dsn(url), autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
