"""`conveyor serve` as a subprocess on one SQLite file, started (and killed) as often as a test likes: the
one-process service exactly as a newcomer runs it."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx

from tests.support.fault_stack import REPO_ROOT, conveyor_command
from tests.support.live_server import free_port, wait_for

START_S = 180.0  # a hang guard for a model load on a busy machine


class Serve:
    """`conveyor serve` on one SQLite file, started (and killed) as often as a test likes."""

    def __init__(self, tmp: Path, model_dir: Path, **settings: str) -> None:
        """`settings`: CONVEYOR_* values by their name without the prefix (AUTH_ENABLED="true", ...)."""
        self.url = f"http://127.0.0.1:{free_port()}"
        self.database_url = f"sqlite:///{tmp / 'conveyor.db'}"
        self.log = tmp / "serve.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
        env.update({f"CONVEYOR_{k}": v for k, v in {
            "DATA_DIR": str(tmp / "data"), "DATABASE_URL": self.database_url, "MODEL": str(model_dir),
            "AUTH_ENABLED": "false", "NUM_THREADS": "1", "RECONCILE_INTERVAL_S": "0.5",
            "DISPATCH_GRACE_S": "1", "WORKER_HEARTBEAT_S": "0.5", "WORKER_DEAD_AFTER_S": "4",
            **settings}.items()})
        env.update(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        port = self.url.rsplit(":", 1)[1]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(conveyor_command("serve", "--port", port), env=self.env,
                                         cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        wait_for(self._answers, "conveyor serve to answer", timeout_s=START_S)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def __enter__(self) -> Serve:
        return self

    def __exit__(self, *_exc: object) -> None:
        """Whatever the test did, no process is left behind."""
        if self.proc is not None and self.proc.poll() is None:
            self.kill()

    def _answers(self) -> bool:
        assert self.proc is not None
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        try:
            return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False


