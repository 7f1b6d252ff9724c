"""Alembic environment: one history for PostgreSQL and SQLite (batch mode for SQLite's ALTER TABLE)."""

from __future__ import annotations

from alembic import context

from conveyor.core.store.database import make_db_engine
from conveyor.core.store.tables import Base


def _database_url() -> str:
    url = context.config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from conveyor.core.settings import load_settings

    return load_settings().database_url


def run_migrations_online() -> None:
    db_engine = make_db_engine(_database_url())
    with db_engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=Base.metadata,
            render_as_batch=connection.dialect.name == "sqlite",
        )
        with context.begin_transaction():
            context.run_migrations()
    db_engine.dispose()


def run_migrations_offline() -> None:
    context.configure(url=_database_url(), target_metadata=Base.metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
