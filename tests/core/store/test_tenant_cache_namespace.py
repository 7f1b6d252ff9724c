"""The tenant's prefix-cache salt: its own by default, its namespace's once set, read for many tenants in one
query (SQLite and PostgreSQL); a namespace is checked like any other tenant override."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from sqlalchemy import event
from sqlalchemy.orm import Session

from conveyor.core.store import keys, tenants
from conveyor.core.store.tables import Tenant

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)


def test_the_salt_is_the_tenants_own_unless_it_has_a_namespace() -> None:
    assert tenants.cache_salt("alice", None) == "tenant:alice"
    assert tenants.cache_salt("alice", "acme") == "namespace:acme"
    assert tenants.cache_salt("acme", None) != tenants.cache_salt("bob", "acme"), "an id is never a namespace"


def test_cache_salts_reads_every_tenant_in_one_query(session: Session) -> None:
    for tenant_id in ("alice", "bob", "carol"):
        keys.ensure_tenant(session, tenant_id, T0)
    tenants.set_overrides(session, "alice", {"cache_namespace": "acme"}, T0)
    tenants.set_overrides(session, "bob", {"cache_namespace": "acme"}, T0)
    statements: list[str] = []

    def count(conn: object, cursor: object, statement: str, *args: object) -> None:
        statements.append(statement)

    event.listen(session.get_bind(), "before_cursor_execute", count)
    salts = tenants.cache_salts(session, ["alice", "bob", "carol", "alice", "never-seen"])
    event.remove(session.get_bind(), "before_cursor_execute", count)
    assert salts == {"alice": "namespace:acme", "bob": "namespace:acme", "carol": "tenant:carol",
                     "never-seen": "tenant:never-seen"}
    assert len(statements) == 1
    assert tenants.cache_salts(session, []) == {}


def test_a_namespace_is_cleared_with_none_and_bad_names_are_refused(session: Session) -> None:
    tenants.set_overrides(session, "alice", {"cache_namespace": "acme"}, T0)
    assert tenants.overrides_of(session.get(Tenant, "alice"))["cache_namespace"] == "acme"
    tenants.set_overrides(session, "alice", {"cache_namespace": None}, T0)
    assert tenants.cache_salts(session, ["alice"]) == {"alice": "tenant:alice"}
    for bad in ("", " acme", "x" * 65, 7):
        with pytest.raises(ValueError, match="cache_namespace"):
            tenants.set_overrides(session, "alice", {"cache_namespace": bad}, T0)
