"""Fixtures of the fault-injection suite: its own PostgreSQL cluster and redis-server (started once per
session, on free loopback ports, so the tests may kill and restart them without touching the shared services),
the migrated database, the demo model, a webhook receiver, and per test a `stack` of `conveyor api` /
`conveyor worker` subprocesses, killed at teardown, whose logs are attached to the report of a failed test.

When the servers cannot be started here (binaries missing), the fixtures FAIL the tests: service tests never
skip.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

import pytest

from tests.support.fault_servers import (
    FaultPostgres,
    FaultRedis,
    SuiteSetupError,
    find_postgres_bin,
    find_redis_server,
)
from tests.support.fault_stack import REPO_ROOT, ApiServer, Servers, Stack, WebhookReceiver, conveyor_command
from tests.support.fault_store import Store, empty_store, store_engine

STACK_KEY = pytest.StashKey[Stack]()


def _setup_failure(exc: Exception) -> NoReturn:
    """Fails (never skips) every fault test with why the suite cannot run here."""
    raise pytest.fail.Exception(f"fault suite cannot run: {exc}", pytrace=False) from None


@pytest.fixture(scope="session")
def fault_pg() -> Iterator[FaultPostgres]:
    """The suite's own PostgreSQL cluster; `fault_pg.outage(s)`, `.stop()`, `.start()` play an outage."""
    try:
        pg = FaultPostgres(find_postgres_bin())
    except SuiteSetupError as exc:
        _setup_failure(exc)
    try:
        pg.init()
    except (SuiteSetupError, OSError, subprocess.SubprocessError) as exc:
        pg.destroy()
        _setup_failure(exc)
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _interrupt)  # a CI timeout's SIGTERM still tears the servers down
    try:
        yield pg
    finally:
        signal.signal(signal.SIGTERM, previous)
        pg.destroy()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture
def pg_outage(fault_pg: FaultPostgres) -> Callable[[float], None]:
    """`pg_outage(seconds)`: the cluster stopped (fast shutdown: every session dropped) for that long, then
    started again on the same data folder and port. Blocks for the whole outage."""
    return fault_pg.outage


@pytest.fixture(scope="session")
def fault_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultRedis]:
    """The suite's own redis-server (no persistence); `kill_and_restart_empty()` loses every message."""
    try:
        find_redis_server()
    except SuiteSetupError as exc:
        _setup_failure(exc)
    server = FaultRedis(tmp_path_factory.mktemp("fault-redis"))
    try:
        server.start()
    except AssertionError as exc:
        server.stop()
        _setup_failure(SuiteSetupError(f"redis-server did not start: {exc}"))
    yield server
    server.stop()


@pytest.fixture
def redis_restart_empty(fault_redis: FaultRedis) -> Callable[..., None]:
    """`redis_restart_empty(down_s=0)`: redis-server SIGKILLed and started again, empty, on the same port."""
    return fault_redis.kill_and_restart_empty


@pytest.fixture(scope="session")
def fault_db_url(fault_pg: FaultPostgres, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The cluster's database, migrated once with `conveyor migrate`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(CONVEYOR_DATABASE_URL=fault_pg.url, PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run(conveyor_command("migrate"), env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)
    if done.returncode != 0:
        pytest.fail(f"`conveyor migrate` failed ({done.returncode}):\n{done.stdout}\n{done.stderr}",
                    pytrace=False)
    return fault_pg.url


@pytest.fixture(scope="session")
def fault_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight demo model, built once, with room (4096 positions) for long jobs, and 24 layers:
    a long job must still be running when a test kills, pauses or stops its worker. With the default 2 layers
    a quiet machine decoded ~1000 tokens a second (800 tokens were done within a 1 s grace); with 8, a quiet
    machine later ran 4 jobs of 800 tokens in under 2 s and a 4000-token blocker in 6.8 s, both inside
    windows the tests need them to outlast. A step's cost grows with the layers, so 24 gives those 3x."""
    from conveyor.engine.demo import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("fault-model"), max_position_embeddings=4096,
                            num_hidden_layers=24)


@pytest.fixture(scope="session")
def webhook_receiver() -> Iterator[WebhookReceiver]:
    receiver = WebhookReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="session")
def fault_store(fault_db_url: str) -> Iterator[Store]:
    db = store_engine(fault_db_url)
    yield Store(db)
    db.dispose()


@pytest.fixture(scope="session")
def fault_servers(fault_pg: FaultPostgres, fault_redis: FaultRedis, fault_db_url: str, fault_model_dir: Path,
                  fault_store: Store) -> Servers:
    return Servers(fault_db_url, fault_pg, fault_redis, fault_model_dir, fault_store)


@pytest.fixture(scope="session")
def fault_api(fault_servers: Servers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    """`conveyor api`, shared by the tests (started on first use; a test that kills it restarts it)."""
    api = ApiServer(fault_servers, tmp_path_factory.mktemp("fault-api"))
    yield api
    api.stop()


@pytest.fixture
def stack(
    request: pytest.FixtureRequest, fault_servers: Servers, fault_api: ApiServer,
    webhook_receiver: WebhookReceiver, tmp_path: Path,
) -> Iterator[Stack]:
    """A clean slate (servers up, store emptied, broker flushed, one webhook subscription to all job events,
    the API answering) and the test's worker processes, every one killed at teardown."""
    fault_servers.pg.ensure_running()
    fault_servers.redis.ensure_running()
    fault_servers.redis.flush()
    empty_store(fault_servers.store.db)
    fault_servers.store.subscribe(webhook_receiver.url)
    fault_api.ensure_running()
    fault_api.mark_logs()
    stack = Stack(fault_servers, fault_api, tmp_path)
    request.node.stash[STACK_KEY] = stack
    try:
        yield stack
    finally:
        stack.kill_all()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed fault test shows the tail of every process log it started (and the cluster's)."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    stack = item.stash.get(STACK_KEY, None)
    if stack is not None and report.failed and report.when in ("setup", "call"):
        for title, text in stack.log_sections():
            report.sections.append((title, text))
