"""One Alembic history for both backends: upgrading a fresh database gives exactly the models' schema."""

from __future__ import annotations

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text

from core.store.database import make_db_engine
from core.store.migrate import alembic_config, upgrade
from core.store.tables import Base


@pytest.fixture(params=["sqlite", "postgres"])
def fresh_url(request: pytest.FixtureRequest) -> str:
    name = "sqlite_url" if request.param == "sqlite" else "fresh_postgres_url"
    return str(request.getfixturevalue(name))


def test_upgrade_head_matches_the_models(fresh_url: str) -> None:
    upgrade(fresh_url)
    upgrade(fresh_url)  # a second run is a no-op
    db_engine = make_db_engine(fresh_url)
    head = ScriptDirectory.from_config(alembic_config(fresh_url)).get_current_head()  # one linear history
    with db_engine.connect() as conn:
        current = MigrationContext.configure(conn).get_current_revision()
        assert current == head == "0009_tenant_cache_namespace"
        assert {"tenants", "api_keys", "jobs", "workers"} <= set(inspect(conn).get_table_names())
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
        assert conn.execute(text("SELECT id FROM tenants")).scalars().all() == ["default"]
    db_engine.dispose()


def test_existing_tenants_keep_their_own_cache_partition_and_the_namespace_downgrades(fresh_url: str) -> None:
    upgrade(fresh_url, "0008_metric_counts")
    db_engine = make_db_engine(fresh_url)
    with db_engine.begin() as conn:
        conn.execute(text("INSERT INTO tenants (id, created_at) VALUES ('alice', CURRENT_TIMESTAMP)"))
    upgrade(fresh_url)
    with db_engine.connect() as conn:
        rows = conn.execute(text("SELECT id, cache_namespace FROM tenants ORDER BY id")).all()
        assert [tuple(row) for row in rows] == [("alice", None), ("default", None)]
    command.downgrade(alembic_config(fresh_url), "0008_metric_counts")
    with db_engine.connect() as conn:
        assert "cache_namespace" not in {c["name"] for c in inspect(conn).get_columns("tenants")}
    db_engine.dispose()
