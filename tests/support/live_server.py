"""Real servers for the service tests: the app under uvicorn on an ephemeral loopback port, API keys, and
a private redis-server to stop and start.

Imported as `tests.support.live_server`.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from conveyor.core.clock import utcnow
from conveyor.core.store import keys
from conveyor.core.store.database import make_db_engine, make_session_factory

WAIT_S = 120.0  # a hang guard, not a speed assertion


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """uvicorn on an ephemeral loopback port in a thread; yields the base URL (no trailing slash)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, "uvicorn to start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def new_api_key(database_url: str, tenant: str) -> str:
    """A fresh API key of `tenant`, created straight in the store (as `conveyor keys create` does)."""
    db_engine = make_db_engine(database_url)
    try:
        with make_session_factory(db_engine)() as session:
            return keys.create_key(session, tenant, utcnow())[1]
    finally:
        db_engine.dispose()


class SpareRedis:
    """A private redis-server on a free port, started on demand: 'the broker is down' until start()."""

    def __init__(self, data_dir: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._data_dir = data_dir
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self._data_dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_for(self._reachable, f"redis-server on port {self.port}", timeout_s=20)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=30)

    def _reachable(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
            return True
        except OSError:
            return False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
