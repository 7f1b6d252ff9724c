"""A command that cannot reach its database or broker says so in one line on stderr (what it tried, what went
wrong, the likely fix) and exits 2; `conveyor --debug` shows the traceback instead."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conveyor.cli.errors import one_line
from conveyor.cli.main import app
from conveyor.core.store.migrate import upgrade
from tests.support.live_server import free_port

runner = CliRunner()
REPO_ROOT = Path(__file__).resolve().parents[2]
POSTGRES = os.environ.get("CONVEYOR_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def _conveyor(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The real command in a subprocess: its stderr is exactly what a user sees."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    clean.update(env, PYTHONPATH=str(REPO_ROOT))
    return subprocess.run([sys.executable, "-m", "conveyor", *args], env=clean, capture_output=True,
                          text=True, timeout=120, cwd=REPO_ROOT)


def _url_with_role(role: str, password: str = "") -> str:
    server = POSTGRES.split("://", 1)[1].split("@", 1)[1]  # host:port/db
    secret = f":{password}" if password else ""
    return f"postgresql+psycopg://{role}{secret}@{server}"


def test_migrate_as_a_role_that_does_not_exist_prints_one_line_naming_it_and_the_fix() -> None:
    role = "nobody_" + secrets.token_hex(4)
    done = _conveyor("migrate", CONVEYOR_DATABASE_URL=_url_with_role(role, "s3cret"))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f'role "{role}" does not exist' in lines[0]
    assert f"createuser -h 127.0.0.1 -U postgres {role}" in lines[0]
    assert "s3cret" not in lines[0] and f"{role}:***@" in lines[0]  # what it tried, password masked
    assert "Traceback" not in done.stderr


def test_debug_shows_the_traceback() -> None:
    url = _url_with_role("nobody_" + secrets.token_hex(4))
    done = _conveyor("--debug", "migrate", CONVEYOR_DATABASE_URL=url)
    assert done.returncode != 0 and "Traceback" in done.stderr and "does not exist" in done.stderr


def test_migrate_against_a_closed_port_prints_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    monkeypatch.setenv("CONVEYOR_DATABASE_URL", f"postgresql+psycopg://postgres@127.0.0.1:{port}/conveyor")
    result = runner.invoke(app, ["migrate"])
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert "Connection refused" in result.stderr and f"start PostgreSQL on 127.0.0.1:{port}" in result.stderr


def test_api_with_the_broker_down_prints_one_line_before_serving(
    monkeypatch: pytest.MonkeyPatch, sqlite_url: str, demo_model_dir: Path
) -> None:
    upgrade(sqlite_url)
    port = free_port()
    monkeypatch.setenv("CONVEYOR_DATABASE_URL", sqlite_url)
    monkeypatch.setenv("CONVEYOR_MODEL", str(demo_model_dir))
    monkeypatch.setenv("CONVEYOR_BROKER_URL", f"redis://:pw@127.0.0.1:{port}/0")
    result = runner.invoke(app, ["api", "--port", str(free_port())])
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert f"cannot reach the broker redis://:***@127.0.0.1:{port}/0" in result.stderr
    assert "CONVEYOR_BROKER_URL" in result.stderr


def test_worker_on_a_database_never_migrated_says_run_migrate(
    monkeypatch: pytest.MonkeyPatch, sqlite_url: str, redis_url: str
) -> None:
    monkeypatch.setenv("CONVEYOR_DATABASE_URL", sqlite_url)
    monkeypatch.setenv("CONVEYOR_BROKER_URL", redis_url)
    monkeypatch.setenv("CONVEYOR_MODEL", "/nonexistent-model-" + secrets.token_hex(4))
    missing_model = runner.invoke(app, ["worker"])
    assert missing_model.exit_code == 2 and "model folder /nonexistent-model-" in missing_model.stderr
    assert "does not exist" in missing_model.stderr

    monkeypatch.delenv("CONVEYOR_MODEL")
    result = runner.invoke(app, ["worker"])  # fails before the demo model is built or an engine loads
    assert result.exit_code == 2 and "conveyor migrate" in result.stderr, result.stderr


def test_other_errors_keep_their_traceback() -> None:
    assert one_line(RuntimeError("a bug")) is None
    assert one_line(KeyError("jobs")) is None


def test_an_invocations_debug_flag_stays_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/conveyor"
    monkeypatch.setenv("CONVEYOR_DATABASE_URL", url)
    with_debug = runner.invoke(app, ["--debug", "migrate"])
    assert with_debug.exit_code != 2 and with_debug.exception is not None  # the traceback, not one line
    without = runner.invoke(app, ["migrate"])
    assert without.exit_code == 2 and "Connection refused" in without.stderr


def test_a_worker_of_a_registry_must_name_a_served_model(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, redis_url: str
) -> None:
    config = tmp_path / "models.toml"
    config.write_text('[models.small]\npath = "/models/small"\n[models.large]\npath = "/models/large"\n')
    monkeypatch.setenv("CONVEYOR_CONFIG_FILE", str(config))
    monkeypatch.setenv("CONVEYOR_BROKER_URL", redis_url)
    unnamed = runner.invoke(app, ["worker"])
    assert unnamed.exit_code == 2 and unnamed.stderr.count("\n") == 1, unnamed.stderr
    assert "2 models are served (small, large)" in unnamed.stderr and "--model" in unnamed.stderr
    unknown = runner.invoke(app, ["worker", "--model", "medium"])
    assert unknown.exit_code == 2 and "worker_model: unknown model 'medium'" in unknown.stderr, unknown.stderr
    named = runner.invoke(app, ["worker", "--model", "large"])  # its folder is checked before anything loads
    assert named.exit_code == 2 and "model folder /models/large does not exist" in named.stderr, named.stderr


@pytest.mark.parametrize("command", ["serve", "api"])
def test_a_port_in_use_is_said_at_once_naming_it_and_how_to_choose_another(command: str,
                                                                          tmp_path: Path) -> None:
    """Before the migrations, the model and the worker's registration: nothing of the start happens (no
    database file is even created), and the line names the port and CONVEYOR_PORT."""
    with socket.socket() as other_server:
        other_server.bind(("127.0.0.1", 0))
        other_server.listen()
        port = other_server.getsockname()[1]
        broker = {"CONVEYOR_BROKER_URL": "redis://127.0.0.1:6379/15"} if command == "api" else {}
        done = _conveyor(command, "--port", str(port), CONVEYOR_DATA_DIR=str(tmp_path), **broker)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "CONVEYOR_PORT" in lines[0], done.stderr
    assert not (tmp_path / "conveyor.db").exists()
