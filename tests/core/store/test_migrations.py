"""One Alembic history for both backends: upgrading a fresh database gives exactly the models' schema."""

from __future__ import annotations

import pytest
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
        assert MigrationContext.configure(conn).get_current_revision() == head == "0008_metric_counts"
        assert {"tenants", "api_keys", "jobs", "workers"} <= set(inspect(conn).get_table_names())
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
        assert conn.execute(text("SELECT id FROM tenants")).scalars().all() == ["default"]
    db_engine.dispose()
