"""`conveyor serve` (the embedded server) in a child process whose threads carry their Python names.

Python 3.11 does not name its threads for the OS: every thread of the server is `python` in /proc. The child
runs `python -m conveyor serve` behind a small prelude that starts one more thread, `thread-namer`, which
every NAME_EVERY_S writes each new thread's Python name (`batch-runner`, `engine-host`, `job-writer`, ...)
into /proc/self/task/TID/comm, so that per-thread CPU (bench/thread_cpu.py) can be read by name from
outside. It writes each thread's name once, so it spends next to nothing; its own CPU is reported apart.
The server code is the installed `conveyor`, or another tree's (`code`: a folder holding a `conveyor`
package, put first on PYTHONPATH): how a before/after comparison runs both in one session.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx

NAMER = "thread-namer"
NAME_EVERY_S = 0.1
START_TIMEOUT_S = 180.0  # a preset model is built on first start

_PRELUDE = f"""
import runpy, sys, threading, time

def _name_threads():
    named = set()
    while True:
        for thread in threading.enumerate():
            tid = thread.native_id
            if tid is not None and tid not in named:
                try:
                    with open(f"/proc/self/task/{{tid}}/comm", "w") as comm:
                        comm.write(thread.name[:15])
                except OSError:
                    pass
                named.add(tid)
        time.sleep({NAME_EVERY_S})

threading.Thread(target=_name_threads, name="{NAMER}", daemon=True).start()
sys.argv = ["conveyor", *sys.argv[1:]]
runpy.run_module("conveyor", run_name="__main__", alter_sys=True)
"""


@dataclass
class ServedProcess:
    """One `conveyor serve` on 127.0.0.1:`port` with the settings in `env` (CONVEYOR_*), its data in
    `data_dir`; `cpus`: pinned with taskset; `code`: a folder holding the `conveyor` to run (None: the
    installed one)."""

    port: int
    data_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    cpus: Sequence[int] | None = None
    code: Path | None = None
    log_path: Path | None = None
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None, "started"
        return self.process.pid

    def start(self) -> ServedProcess:
        env = {**os.environ, "CONVEYOR_DATA_DIR": str(self.data_dir), **self.env}
        if self.code is not None:
            if not (self.code / "conveyor" / "__init__.py").is_file():
                raise ValueError(f"code: {self.code} holds no conveyor package (conveyor/__init__.py)")
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.code), env.get("PYTHONPATH")]))
        command = [sys.executable, "-c", _PRELUDE, "serve", "--port", str(self.port)]
        if self.cpus is not None:
            command = ["taskset", "-c", ",".join(map(str, self.cpus)), *command]
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = (self.log_path or self.data_dir / "server.log").open("wb")
        self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        self._wait_healthy()
        return self

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def __enter__(self) -> ServedProcess:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode} while starting; see "
                                   f"{self.log_path or self.data_dir / 'server.log'}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"the server on port {self.port} was not ready after {START_TIMEOUT_S:.0f} s")
