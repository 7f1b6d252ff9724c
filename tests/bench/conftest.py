"""`service`: the real embedded service (`conveyor serve` in a subprocess on the tiny model), for the bench's
HTTP tests. The bench itself imports nothing from api/ or worker/; only these tests start them.

Without CUDA the kernel bench's smoke run goes through the Triton interpreter, which must be chosen before
any kernel module is imported; other bench tests import the engine (and so the kernels) first, so it is
chosen here, as tests/kernels/conftest.py does for the whole session when the suites run together.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.live_server import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def service(service_process: tuple[str, int]) -> str:
    return service_process[0]


@pytest.fixture
def service_process(llama_dir: Path, tmp_path: Path) -> Iterator[tuple[str, int]]:
    """(base URL, pid) of `conveyor serve` on the tiny model."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(CONVEYOR_DATA_DIR=str(tmp_path / "data"), CONVEYOR_MODEL=str(llama_dir))
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-c", "from conveyor.cli.main import app; app()", "serve", "--port", str(port)],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, tmp_path / "serve.log")
        yield url, proc.pid
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
