"""`conveyor api --workers N` (cli/api_server.py): N processes serve one port on PostgreSQL and Redis, a long
poll in any of them is woken by a cancel in any other; `serve` and SQLite refuse more than one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from conveyor.cli.main import app
from conveyor.core.store.migrate import upgrade
from tests.support.live_server import free_port, wait_for

runner = CliRunner()
REPO_ROOT = Path(__file__).resolve().parents[2]
LONG_POLL_S = 30  # a long poll not woken would run this long; each must end well before


def _tokenizer_only(demo_model_dir: Path, folder: Path) -> Path:
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(demo_model_dir / name, folder / name)
    return folder


def _children(pid: int) -> list[str]:
    """The command lines of a process's children (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if parent == pid:
                found.append((stat.parent / "cmdline").read_text().replace("\0", " "))
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return found


def _up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _cancelled_while_polled(base: str) -> float:
    """Submits a job, long-polls it on one connection and cancels it on another half a second later: the
    poll's seconds. Woken by the cancel, a poll ends within a moment of it; not woken, it would read the
    store again only FALLBACK_READ_S (5 s) after it began."""
    job = httpx.post(f"{base}/v1/jobs", json={"prompt": "hello", "max_tokens": 2}, timeout=10).json()
    with ThreadPoolExecutor(1) as pool:
        poll = pool.submit(lambda: httpx.get(f"{base}/v1/jobs/{job['id']}", params={"wait": LONG_POLL_S},
                                             timeout=LONG_POLL_S + 10))
        time.sleep(0.5)
        assert httpx.post(f"{base}/v1/jobs/{job['id']}/cancel", timeout=10).status_code == 200
        answer = poll.result()
    assert answer.status_code == 200 and answer.json()["status"] == "cancelled", answer.text
    return answer.elapsed.total_seconds()


def test_several_processes_serve_one_port_and_wake_each_others_long_polls(
    tmp_path: Path, demo_model_dir: Path, redis_url: str, fresh_postgres_url: str,
) -> None:
    upgrade(fresh_postgres_url)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(CONVEYOR_MODEL=str(_tokenizer_only(demo_model_dir, tmp_path / "tokenizer-only")),
               CONVEYOR_BROKER_URL=redis_url, CONVEYOR_DATABASE_URL=fresh_postgres_url,
               CONVEYOR_DATA_DIR=str(tmp_path), PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "conveyor", "api", "--port", str(port), "--workers", "2"],
                            env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _up(f"{base}/healthz"), "conveyor api --workers 2 to start")
        serving = [cmdline for cmdline in _children(proc.pid) if "spawn_main" in cmdline]
        assert len(serving) == 2, _children(proc.pid)
        # Connections land on either process; every long poll ends on its cancel, wherever each ran.
        seconds = [_cancelled_while_polled(base) for _ in range(6)]
        assert max(seconds) < 4.0, seconds
    finally:
        proc.terminate()
        output = proc.communicate(timeout=60)[0].decode(errors="replace")
    assert "2 processes" in output, output


def test_serve_and_sqlite_refuse_several_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     redis_url: str, demo_model_dir: Path) -> None:
    monkeypatch.setenv("CONVEYOR_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("CONVEYOR_API_WORKERS", "2")
    served = runner.invoke(app, ["serve", "--port", "8125"])
    assert served.exit_code == 2 and "serve runs one process" in served.output, served.output
    monkeypatch.setenv("CONVEYOR_BROKER_URL", redis_url)
    monkeypatch.setenv("CONVEYOR_MODEL", str(demo_model_dir))
    api = runner.invoke(app, ["api", "--port", "8125"])
    assert api.exit_code == 2 and "need PostgreSQL" in api.output, api.output
