"""Worker test fixtures: a migrated Postgres database emptied per test, the tiny demo model (with room for
long jobs), and Celery worker subprocesses that are always killed at teardown."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.store.database import make_db_engine, make_session_factory
from tests.support.worker import WorkerProcesses


@pytest.fixture(scope="session")
def worker_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight demo model, with 4096 positions so a job can run for a few seconds."""
    from conveyor.engine.demo import build_tiny_model

    folder = tmp_path_factory.mktemp("worker-model") / "demo-model"  # its id: tests/support/worker.TEST_MODEL
    return build_tiny_model(folder, max_position_embeddings=4096)


@pytest.fixture
def pg_url(emptied_postgres: str) -> str:
    """The session's migrated Postgres database with every row of every table removed."""
    return emptied_postgres


@pytest.fixture
def sessions(pg_url: str) -> Iterator[sessionmaker[Session]]:
    db_engine = make_db_engine(pg_url)
    yield make_session_factory(db_engine)
    db_engine.dispose()


@pytest.fixture
def worker_procs(tmp_path: Path) -> Iterator[WorkerProcesses]:
    procs = WorkerProcesses(tmp_path)
    try:
        yield procs
    finally:
        procs.kill_all()
