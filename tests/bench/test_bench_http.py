"""The bench's HTTP target against the real embedded service (`conveyor serve` in a subprocess on the tiny
model): jobs on both queues complete, a job cancelled mid-flight is counted as cancelled, token counts come
from the jobs' usage. The bench itself imports nothing from api/ or worker/; only this test starts them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from live_server import free_port

from bench.cli import main

REPO = Path(__file__).resolve().parents[2]



@pytest.fixture
def service(llama_dir: Path, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(CONVEYOR_DATA_DIR=str(tmp_path / "data"), CONVEYOR_MODEL=str(llama_dir))
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-c", "from cli.main import app; app()", "serve", "--port", str(port)],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, tmp_path / "serve.log")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"conveyor serve exited:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"conveyor serve not healthy after {timeout_s} s:\n{log.read_text()[-3000:]}")


def test_http_target_against_the_embedded_service(service: str, llama_dir: Path, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"group": "interactive", "prompt": "Good morning! How are you today?", "max_tokens": 4},
        {"group": "interactive", "prompt_tokens": 12, "max_tokens": 3, "arrival_s": 0.05},
        {"group": "documents", "prompt_tokens": 80, "max_tokens": 5, "arrival_s": 0.1},
        # Long enough that a 20 ms poll sees it running: the bench cancels it mid-flight.
        {"group": "documents", "prompt_tokens": 40, "max_tokens": 600, "cancel_after_tokens": 1},
    ]
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "http"
    assert (
        main(
            [
                "--target",
                "http",
                "--url",
                service,
                "--model",
                str(llama_dir),
                "--trace",
                str(trace),
                "--poll",
                "0.02",
                "--timeout",
                "120",
                "--no-progress",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads((out / "report.json").read_text())
    metrics = report["runs"]["http"]["metrics"]
    assert (metrics["all"]["submitted"], metrics["all"]["completed"], metrics["all"]["cancelled"]) == (
        4,
        3,
        1,
    )
    assert metrics["all"]["failed"] == 0
    assert metrics["interactive"]["output_tokens"] == 7 and metrics["documents"]["output_tokens"] == 5
    assert metrics["interactive"]["ttft_s"]["p50"] is not None and metrics["all"]["e2e_s"]["p99"] > 0
    assert report["inventory"]["parameters"]["url"] == service
    assert (out / "latency_cdf.png").read_bytes()[:4] == b"\x89PNG"
