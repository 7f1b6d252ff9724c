"""The fault suite's processes: `conveyor api` and `conveyor worker` subprocesses on the suite's own servers
(Stack), each logging to its own file, with the short reliability timings the faults resolve by; and a
webhook receiver."""

from __future__ import annotations

import contextlib
import http.server
import os
import re
import signal
import subprocess
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.fault_servers import LOG_TAIL_LINES, FaultPostgres, FaultRedis, tail
from tests.support.fault_store import Store, wait_until
from tests.support.live_server import free_port
from tests.support.traffic import Traffic

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120.0  # process start-up on a loaded 2-core machine (a worker imports torch)
LONG_OUTPUT_TOKENS = 4000  # the demo model is built with 4096 positions

# The reliability timings every process of the suite runs with: short, so the faults resolve in seconds.
FAST_TIMINGS = {
    "RECONCILE_INTERVAL_S": "0.5",
    "DISPATCH_GRACE_S": "1",
    "WORKER_HEARTBEAT_S": "0.5",
    "WORKER_DEAD_AFTER_S": "4",
    "CANCEL_POLL_S": "0.2",
}
DEAD_AFTER_S = float(FAST_TIMINGS["WORKER_DEAD_AFTER_S"])
# A worker's completion that lost the race to another attempt (worker/job_runner.py logs it): evidence that
# the job ran twice, harmless only when its worker was (or looked) dead.
DROPPED_RESULT = re.compile(r"job (job_[0-9a-f]+) attempt (\d+) finished but is no longer running here")




@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    worker_id: str | None = None  # a worker's id in the store, once it registered

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def kill(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)  # a stopped process must be able to die
            self.popen.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=30)

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            message = f"{self.name} (pid {self.pid}) did not exit within {timeout_s:.0f} s"
            raise AssertionError(message) from None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def check_alive(self) -> None:
        if not self.alive():
            raise AssertionError(f"{self.name} exited with {self.popen.returncode}:\n{tail(self.log_path)}")


def conveyor_command(*args: str) -> list[str]:
    """The `conveyor` console script of this interpreter's environment (or the same through -c)."""
    script = Path(sys.executable).with_name("conveyor")
    if script.is_file():
        return [str(script), *args]
    program = "import sys; from conveyor.cli.main import app; sys.argv[0] = 'conveyor'; app()"
    return [sys.executable, "-c", program, *args]


def suite_env(database_url: str, broker_url: str, model_dir: Path, data_dir: Path,
              **settings: str) -> dict[str, str]:
    """CONVEYOR_* for a process of the suite; keyword names drop the prefix and nest with `__`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    values = {
        "DATABASE_URL": database_url, "BROKER_URL": broker_url, "MODEL": str(model_dir),
        "DATA_DIR": str(data_dir), "HOST": "127.0.0.1", "AUTH_ENABLED": "false", "LOG_LEVEL": "INFO",
        "MAX_NUM_SEQS": "32", "NUM_KV_BLOCKS": "1024", "NUM_THREADS": "1",
        "WEBHOOK_ALLOWLIST": '["127.0.0.1"]',
        "QUEUES__INTERACTIVE__MAX_OUTPUT_TOKENS": str(LONG_OUTPUT_TOKENS),  # room for a long "blocker" job
        **FAST_TIMINGS, **settings,
    }
    env.update({f"CONVEYOR_{k.upper()}": str(v) for k, v in values.items()})
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"  # frugal on a shared machine (the engine's own threads: NUM_THREADS)
    env["AWS_EC2_METADATA_DISABLED"] = "true"  # the batch runner's S3 client must not probe for a cloud
    return env


def spawn(name: str, args: list[str], env: dict[str, str], log_dir: Path) -> Proc:
    log_path = log_dir / f"{name}.log"
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(conveyor_command(*args), env=env, cwd=REPO_ROOT, stdout=log,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return Proc(name, popen, log_path)


@dataclass
class Servers:
    """The session's own servers and what every process of the suite is configured with."""

    database_url: str
    pg: FaultPostgres
    redis: FaultRedis
    model_dir: Path
    store: Store

    def env(self, data_dir: Path, **settings: str) -> dict[str, str]:
        return suite_env(self.database_url, self.redis.url, self.model_dir, data_dir, **settings)


class ApiServer:
    """`conveyor api` on a fixed port for the whole session (it loads no model and holds no job state, so
    the tests share it); a test that kills it restarts it, and the next test finds it running again."""

    def __init__(self, servers: Servers, log_dir: Path) -> None:
        self.servers = servers
        self.log_dir = log_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[Proc] = []
        self._log_marks: dict[Path, int] = {}

    @property
    def proc(self) -> Proc | None:
        return self.procs[-1] if self.procs else None

    def start(self, wait: bool = True) -> Proc:
        env = self.servers.env(self.log_dir / "data", PORT=str(self.port))
        proc = spawn(f"api-{len(self.procs)}", ["api"], env, self.log_dir)
        self.procs.append(proc)
        if wait:
            self.wait(proc)
        return proc

    def wait(self, proc: Proc | None = None) -> None:
        proc = proc or self.proc
        assert proc is not None

        def up() -> bool:
            return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200

        wait_until(up, f"{proc.name} to answer /healthz", START_TIMEOUT_S, also=proc.check_alive)

    def ensure_running(self) -> None:
        if self.proc is None or not self.proc.alive():
            self.start()
        else:
            self.wait()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()

    def mark_logs(self) -> None:
        """Remembers where each log ends now: a failed test shows only what its own time added."""
        self._log_marks = {p.log_path: p.log_path.stat().st_size for p in self.procs if p.log_path.exists()}

    def log_sections(self) -> list[tuple[str, str]]:
        sections = []
        for proc in self.procs:
            mark = self._log_marks.get(proc.log_path, 0)
            try:
                with open(proc.log_path, "rb") as log:
                    log.seek(mark)
                    text = log.read().decode(errors="replace")
            except OSError as exc:
                text = f"<{exc}>"
            if text or proc.log_path not in self._log_marks:
                lines = text.splitlines()[-LOG_TAIL_LINES:]
                sections.append((f"{proc.name} (pid {proc.pid}) log during this test, last {LOG_TAIL_LINES} "
                                 "lines", "\n".join(lines)))
        return sections

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()


@dataclass
class Stack:
    """What one test runs on: the session's servers and API, and its own `conveyor worker` processes."""

    servers: Servers
    api: ApiServer
    log_dir: Path
    procs: list[Proc] = field(default_factory=list)
    traffics: list[Traffic] = field(default_factory=list)

    def traffic(self, rate: float = 10.0, **kwargs: Any) -> Traffic:
        """Traffic to the API, stopped at teardown whatever happened."""
        traffic = Traffic(self.api.url, rate=rate, **kwargs)
        self.traffics.append(traffic)
        return traffic

    @property
    def store(self) -> Store:
        return self.servers.store

    @property
    def pg(self) -> FaultPostgres:
        return self.servers.pg

    @property
    def redis(self) -> FaultRedis:
        return self.servers.redis

    @property
    def api_url(self) -> str:
        return self.api.url

    def start_worker(self, wait: bool = True, **settings: str) -> Proc:
        name = f"worker-{len(self.procs)}"
        proc = spawn(name, ["worker"], self.servers.env(self.log_dir / "data", **settings), self.log_dir)
        self.procs.append(proc)
        if wait:
            self.wait_worker(proc)
        return proc

    def start_workers(self, n: int, **settings: str) -> list[Proc]:
        """n workers started together (their start-ups overlap), each waited for."""
        procs = [self.start_worker(wait=False, **settings) for _ in range(n)]
        for proc in procs:
            self.wait_worker(proc)
        return procs

    def wait_worker(self, proc: Proc) -> str:
        """Waits until the worker registered in the store (its engine is loaded) and its job consumer is
        consuming; returns its worker id."""
        def registered() -> bool:
            proc.worker_id = self.store.worker_id_of_pid(proc.pid)
            return proc.worker_id is not None

        wait_until(registered, f"{proc.name} to register", START_TIMEOUT_S, also=proc.check_alive)
        with contextlib.suppress(AssertionError):  # the log line is a nicety: registration is the contract
            wait_until(lambda: "consuming job queues" in proc.log(), f"{proc.name} to consume", 20,
                       also=proc.check_alive)
        assert proc.worker_id is not None
        return proc.worker_id

    def workers(self) -> list[Proc]:
        return list(self.procs)

    def kill_all(self) -> None:
        for traffic in self.traffics:
            traffic.close()
        for proc in self.procs:
            proc.kill()

    def log_sections(self) -> list[tuple[str, str]]:
        sections = [(f"{p.name} (pid {p.pid}) log, last {LOG_TAIL_LINES} lines", tail(p.log_path))
                    for p in self.procs]
        sections += self.api.log_sections()
        sections.append(("postgres log", tail(self.pg.log_path, 40)))
        return sections

    def dropped_results(self) -> Counter[str]:
        """Per job: completions its workers computed but could not store because another attempt owned it."""
        found: Counter[str] = Counter()
        for proc in self.procs:
            for match in DROPPED_RESULT.finditer(proc.log()):
                found[match.group(1)] += 1
        return found


# --- the webhook receiver -----------------------------------------------------------------------------------


class WebhookReceiver:
    """Answers 204 to every POST (the workers' webhook senders deliver the job events here)."""

    def __init__(self) -> None:
        received: list[bytes] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                received.append(self.rfile.read(length))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.received = received
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/hooks"
        self._thread = threading.Thread(target=self._server.serve_forever, name="webhook-receiver",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
