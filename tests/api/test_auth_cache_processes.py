"""Two `conveyor api` processes on one PostgreSQL database, each caching keys and limits for 30 s: a key
revoked with `conveyor keys revoke`, and a max_queued lowered with `conveyor tenants set`, apply in both at
once (within NOTICE_S, far below the 30 s a cached copy would live), while a key revoked straight in the
database, which announces nothing, is still answered from both caches: what makes them apply at once is
the notice, not the lack of a cache."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import update
from typer.testing import CliRunner

from conveyor.cli.main import app
from conveyor.core.clock import utcnow
from conveyor.core.store import keys
from conveyor.core.store.database import make_db_engine, make_session_factory
from conveyor.core.store.migrate import upgrade
from conveyor.core.store.tables import ApiKey
from tests.support.live_server import free_port, wait_for

runner = CliRunner()
REPO_ROOT = Path(__file__).resolve().parents[2]
AUTH_CACHE_S = 30
NOTICE_S = 5.0
JOB = {"prompt": "hello there", "max_tokens": 4}


def _tokenizer_only(demo_model_dir: Path, folder: Path) -> Path:
    """What `conveyor api` loads of a model: its tokenizer files."""
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(demo_model_dir / name, folder / name)
    return folder


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def two_apis(tmp_path: Path, demo_model_dir: Path, redis_url: str, fresh_postgres_url: str,
             ) -> Iterator[list[str]]:
    """The base URLs of two `conveyor api` processes sharing the database (and the broker)."""
    upgrade(fresh_postgres_url)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(CONVEYOR_MODEL=str(_tokenizer_only(demo_model_dir, tmp_path / "tokenizer-only")),
               CONVEYOR_BROKER_URL=redis_url, CONVEYOR_DATABASE_URL=fresh_postgres_url,
               CONVEYOR_DATA_DIR=str(tmp_path), CONVEYOR_AUTH_ENABLED="true",
               CONVEYOR_AUTH_CACHE_S=str(AUTH_CACHE_S), PYTHONPATH=str(REPO_ROOT))
    ports = [free_port(), free_port()]
    processes = [subprocess.Popen([sys.executable, "-m", "conveyor", "api", "--port", str(port)], env=env,
                                  cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
                 for port in ports]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        for url in urls:
            wait_for(lambda url=url: _up(url), f"conveyor api at {url} to start")  # type: ignore[misc]
        yield urls
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=60)


def _status(url: str, key: str, method: str = "GET", path: str = "/v1/jobs") -> int:
    body = JOB if method == "POST" else None
    return httpx.request(method, f"{url}{path}", json=body, headers={"Authorization": f"Bearer {key}"},
                         timeout=10).status_code


def test_a_revocation_and_a_limit_change_apply_in_both_processes_at_once(
    two_apis: list[str], fresh_postgres_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    db_engine = make_db_engine(fresh_postgres_url)
    sessions = make_session_factory(db_engine)
    with sessions() as session:
        revoked_row, revoked = keys.create_key(session, "alice", utcnow())
        silent_row, silent = keys.create_key(session, "alice", utcnow())
        _, submitting = keys.create_key(session, "alice", utcnow())
    for url in two_apis:  # each process reads the keys and alice's limits into its cache
        assert [_status(url, key) for key in (revoked, silent)] == [200, 200]
        assert _status(url, submitting, "POST") == 202

    with sessions() as session:  # straight in the database: no notice, so both go on answering it
        session.execute(update(ApiKey).where(ApiKey.id == silent_row.id).values(revoked_at=utcnow()))
        session.commit()
    assert [_status(url, silent) for url in two_apis] == [200, 200]

    monkeypatch.setenv("CONVEYOR_DATABASE_URL", fresh_postgres_url)
    done = runner.invoke(app, ["keys", "revoke", revoked_row.id])
    assert done.exit_code == 0, done.output
    wait_for(lambda: [_status(url, revoked) for url in two_apis] == [401, 401],
             "both processes to refuse the revoked key", NOTICE_S)

    done = runner.invoke(app, ["tenants", "set", "alice", "--max-queued", "1"])  # alice has 2 queued
    assert done.exit_code == 0, done.output
    wait_for(lambda: [_status(url, submitting, "POST") for url in two_apis] == [429, 429],
             "both processes to apply alice's max_queued", NOTICE_S)
    db_engine.dispose()
