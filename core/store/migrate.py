"""`alembic upgrade head`, run programmatically (conveyor migrate, embedded serve, tests)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from alembic import command
from alembic.config import Config

from conveyor.core.log_setup import masked_url

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


@dataclass(frozen=True)
class Upgraded:
    """What an upgrade did: the schema revision before and after (None: an empty database)."""

    database_url: str
    before: str | None
    after: str | None

    def describe(self) -> str:
        """One line for the user, in place of alembic's own INFO lines."""
        where = masked_url(self.database_url)
        if self.before == self.after:
            return f"database {where}: schema at revision {self.after} (the latest revision)"
        return (f"database {where}: migrated from {self.before or 'an empty database'} to revision "
                f"{self.after} (the latest revision)")


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # ConfigParser interpolation: a literal % in a password must be doubled.
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head", *, default_model: str | None = None) -> Upgraded:
    """`default_model`: the id of the model the jobs stored so far belong to, when a revision needs it
    (0017, lanes); unset, it is read from the settings."""
    _ensure_sqlite_dir(database_url)
    before = current_revision(database_url)
    config = alembic_config(database_url)
    config.attributes["default_model"] = default_model
    command.upgrade(config, revision)
    return Upgraded(database_url, before, current_revision(database_url))


def current_revision(database_url: str) -> str | None:
    """The database's schema revision; None when it has none (empty, never migrated)."""
    from alembic.migration import MigrationContext

    from conveyor.core.store.database import make_db_engine

    db_engine = make_db_engine(database_url)
    try:
        with db_engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        db_engine.dispose()


def head_revision() -> str | None:
    """The latest revision this code knows (one linear history)."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config("")).get_current_head()


def _ensure_sqlite_dir(database_url: str) -> None:
    from sqlalchemy.engine import make_url

    url = make_url(database_url)
    if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
