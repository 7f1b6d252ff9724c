"""The per-process cache of API keys and tenant limits over a real store (SQLite and PostgreSQL): an active
key and a tenant's limits are read once per auth_cache_s; unknown keys are never cached; a notice drops its
entry at once, and a lookup that read the store before a revocation does not store the key after the
revocation's notice; with no notice, the TTL is the bound."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone

import pytest
from sqlalchemy import event, update
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.store import auth_notices, keys, tenants
from conveyor.core.store.auth_cache import AuthCache
from conveyor.core.store.keys import KeyGrant
from conveyor.core.store.tables import ApiKey
from conveyor.core.store.tenants import TenantLimits

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
DEFAULTS = TenantLimits(max_queued=100)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextmanager
def counted_queries(session: Session) -> Iterator[list[str]]:
    statements: list[str] = []

    def count(conn: object, cursor: object, statement: str, *args: object) -> None:
        statements.append(statement)

    event.listen(session.get_bind(), "before_cursor_execute", count)
    try:
        yield statements
    finally:
        event.remove(session.get_bind(), "before_cursor_execute", count)


def test_an_active_key_is_read_once_and_answered_from_the_cache_until_its_ttl(session: Session) -> None:
    clock = FakeClock()
    cache = AuthCache(30.0, DEFAULTS, clock=clock)
    row, plaintext = keys.create_key(session, "alice", T0, admin=True)
    key_hash = keys.hash_key(plaintext)
    assert cache.cached_grant(key_hash) is None
    with counted_queries(session) as statements:
        assert cache.grant(session, key_hash) == KeyGrant("alice", admin=True)
        assert cache.grant(session, key_hash) == KeyGrant("alice", admin=True)
    assert len(statements) == 1 and cache.cached_grant(key_hash) == KeyGrant("alice", admin=True)
    # Revoked with no notice heard (SQLite has none; a change made straight in the database): the TTL bounds.
    _revoke_without_notice(session, row.id)
    clock.now += 29.9
    assert cache.grant(session, key_hash) == KeyGrant("alice", admin=True)
    clock.now += 0.1
    assert cache.cached_grant(key_hash) is None and cache.grant(session, key_hash) is None


def test_unknown_and_revoked_keys_are_never_cached(session: Session) -> None:
    cache = AuthCache(30.0, DEFAULTS, clock=FakeClock())
    row, plaintext = keys.create_key(session, "alice", T0)
    keys.revoke_key(session, row.id, T0)
    with counted_queries(session) as statements:
        for attempt in range(3):
            assert cache.grant(session, keys.hash_key(f"cvk_made-up-{attempt}")) is None
            assert cache.grant(session, keys.hash_key(plaintext)) is None
    assert len(statements) == 6, "each refusal is read from the store"
    assert cache.cached_grant(keys.hash_key(plaintext)) is None


def test_a_key_notice_drops_the_key_at_once(session: Session) -> None:
    cache = AuthCache(30.0, DEFAULTS, clock=FakeClock())
    row, plaintext = keys.create_key(session, "alice", T0)
    _, other = keys.create_key(session, "bob", T0)
    key_hash = keys.hash_key(plaintext)
    cache.grant(session, key_hash)
    cache.grant(session, keys.hash_key(other))
    assert keys.revoke_key(session, row.id, T0)
    cache.forget(auth_notices.key_revoked(key_hash))  # what the listener does as the notice arrives
    assert cache.cached_grant(key_hash) is None and cache.grant(session, key_hash) is None
    assert cache.cached_grant(keys.hash_key(other)) == KeyGrant("bob", admin=False)


def test_a_lookup_that_read_before_the_revocation_does_not_store_the_key_after_its_notice(
    session_factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The race: the lookup reads the key as active, then the revocation commits and its notice is heard,
    then the lookup would store what it read."""
    cache = AuthCache(30.0, DEFAULTS, clock=FakeClock())
    with session_factory() as session:
        row, plaintext = keys.create_key(session, "alice", T0)
    key_hash = keys.hash_key(plaintext)
    read = keys.grant_of_hash

    def read_then_revoked(lookup_session: Session, wanted: str) -> KeyGrant | None:
        found = read(lookup_session, wanted)
        with session_factory() as other:
            assert keys.revoke_key(other, row.id, T0)
        cache.forget(auth_notices.key_revoked(key_hash))
        return found

    monkeypatch.setattr(keys, "grant_of_hash", read_then_revoked)
    with session_factory() as session:
        assert cache.grant(session, key_hash) == KeyGrant("alice", admin=False)  # what it read, once
    monkeypatch.setattr(keys, "grant_of_hash", read)
    assert cache.cached_grant(key_hash) is None
    with session_factory() as session:
        assert cache.grant(session, key_hash) is None


def test_a_tenants_limits_are_read_once_and_a_notice_drops_them(session: Session) -> None:
    cache = AuthCache(30.0, DEFAULTS, clock=FakeClock())
    with counted_queries(session) as statements:
        assert cache.limits(session, "alice") == DEFAULTS
        assert cache.limits(session, "alice") == DEFAULTS
    assert len(statements) == 1
    tenants.set_overrides(session, "alice", {"max_queued": 1, "weight": 2.0}, T0)
    assert cache.limits(session, "alice") == DEFAULTS, "no notice heard yet: the cached copy"
    cache.forget(auth_notices.limits_changed("alice"))
    assert cache.limits(session, "alice") == TenantLimits(max_queued=1, weight=2.0)


def test_a_notice_not_understood_forgets_everything(session: Session) -> None:
    cache = AuthCache(30.0, DEFAULTS, clock=FakeClock())
    _, plaintext = keys.create_key(session, "alice", T0)
    cache.grant(session, keys.hash_key(plaintext))
    cache.limits(session, "alice")
    cache.forget(auth_notices.decode("gibberish"))
    assert cache.cached_grant(keys.hash_key(plaintext)) is None
    with counted_queries(session) as statements:
        cache.limits(session, "alice")
    assert len(statements) == 1


def test_with_a_ttl_of_zero_every_lookup_reads_the_store(session: Session) -> None:
    cache = AuthCache(0.0, DEFAULTS)
    _, plaintext = keys.create_key(session, "alice", T0)
    with counted_queries(session) as statements:
        for _ in range(3):
            assert cache.grant(session, keys.hash_key(plaintext)) == KeyGrant("alice", admin=False)
            cache.limits(session, "alice")
    assert len(statements) == 6 and not cache.enabled


def test_notices_round_trip_and_anything_else_is_none() -> None:
    for notice in (auth_notices.key_revoked("ab" * 32), auth_notices.limits_changed("team: a:b")):
        assert auth_notices.decode(notice.encode()) == notice
    for payload in ("", "key", "key:", "tenant:", "user:x", ":x"):
        assert auth_notices.decode(payload) is None


def _revoke_without_notice(session: Session, key_id: str) -> None:
    session.execute(update(ApiKey).where(ApiKey.id == key_id).values(revoked_at=T0))
    session.commit()
