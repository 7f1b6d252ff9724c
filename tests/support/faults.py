"""The machinery of the fault-injection suite (`tests.support.faults`; tests/faults/conftest.py holds the
fixtures).

- FaultPostgres: a private PostgreSQL cluster (initdb/pg_ctl into a temporary folder, run as the `postgres`
  user when we are root) on a free loopback port, which a test may stop and start again on the same data.
- `conveyor api` and `conveyor worker` subprocesses (Stack), each logging to its own file.
- Traffic: jobs submitted over HTTP at a steady rate, one Idempotency-Key per job, retried with the same key
  whenever the answer was lost or the service could not take it (connection error, 5xx, 429).
- check_exactly_once: the central assertion, read from the database: every job reached a final state, once,
  for the right reason.

Nothing here touches the shared services on 5432/6379: the fault tests kill and restart their own.
"""

from __future__ import annotations

import contextlib
import glob
import http.server
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
from sqlalchemy import create_engine, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker

from core.lifecycle import TERMINAL_STATUSES
from core.store.tables import DEFAULT_TENANT, Base, Delivery, Job, Tenant, Worker
from tests.support.live_server import SpareRedis, free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
PG_BIN_GLOB = "/usr/lib/postgresql/*/bin"
PG_BIN_ENV = "CONVEYOR_TEST_PG_BIN"  # a folder holding initdb and pg_ctl, when not under PG_BIN_GLOB
POLL_S = 0.25  # how often the suite reads the database while waiting: frugal on a shared 2-core machine
START_TIMEOUT_S = 120.0  # process start-up on a loaded 2-core machine (a worker imports torch)
LOG_TAIL_LINES = 120
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


class SuiteSetupError(RuntimeError):
    """The suite cannot run here (a missing binary, a server that does not start): a failure, never a skip."""


# --- PostgreSQL --------------------------------------------------------------------------------------------


def find_postgres_bin() -> Path:
    """The newest /usr/lib/postgresql/<version>/bin holding initdb and pg_ctl (or $CONVEYOR_TEST_PG_BIN)."""
    override = os.environ.get(PG_BIN_ENV)
    if override:
        candidates = [Path(override)]
    else:
        def version(path: str) -> tuple[int, ...]:
            numbers = re.findall(r"\d+", Path(path).parent.name)
            return tuple(int(n) for n in numbers)

        candidates = [Path(p) for p in sorted(glob.glob(PG_BIN_GLOB), key=version, reverse=True)]
    for folder in candidates:
        if all((folder / tool).is_file() for tool in ("initdb", "pg_ctl", "postgres")):
            return folder
    where = override or PG_BIN_GLOB
    raise SuiteSetupError(
        f"the fault tests need PostgreSQL's server binaries (initdb, pg_ctl, postgres) and found none in "
        f"{where}: install them (Debian: apt-get install postgresql) or point {PG_BIN_ENV} at their folder")


def find_redis_server() -> str:
    path = shutil.which("redis-server")
    if path is None:
        raise SuiteSetupError("the fault tests need redis-server on PATH and found none: install it "
                              "(Debian: apt-get install redis-server)")
    return path


class FaultPostgres:
    """A private cluster on 127.0.0.1:<free port>, trust auth, fsync off. As root, every server command runs
    as the `postgres` user (postgres refuses to run as root) in a temporary folder chowned to it."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin_dir = bin_dir
        self._as_postgres = os.geteuid() == 0
        self.root = Path(tempfile.mkdtemp(prefix="conveyor-faults-pg-"))
        if self._as_postgres:
            try:
                import pwd

                account = pwd.getpwnam("postgres")
            except KeyError as exc:
                raise SuiteSetupError("running as root, the fault tests start PostgreSQL as the `postgres` "
                                      "user, and there is none (install the postgresql package)") from exc
            os.chown(self.root, account.pw_uid, account.pw_gid)
        self.data = self.root / "data"
        self.log_path = self.root / "postgres.log"
        self.port = free_port()
        self.database = "conveyor"
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{self.database}"

    def _run(self, tool: str, *args: str, timeout_s: float = 90.0, check: bool = True) -> int:
        command = [str(self.bin_dir / tool), *args]
        if self._as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=self.root)
        if check and done.returncode != 0:
            raise SuiteSetupError(f"{tool} {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n"
                                  f"{done.stderr}\n{self.log_tail()}")
        return done.returncode

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        self.start()
        import psycopg

        admin = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        with psycopg.connect(admin, autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'CREATE DATABASE "{self.database}"')

    def start(self) -> None:
        options = (f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.root} "
                   "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=300")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log_path), "-w", "-t", "90", "-o", options,
                  "start")

    def stop(self, mode: str = "fast") -> None:
        """Stops the server; `fast` ends every session at once (clients see their connections drop)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "90", "stop")

    def is_running(self) -> bool:
        return self._run("pg_ctl", "-D", str(self.data), "status", check=False) == 0

    def ensure_running(self) -> None:
        if not self.is_running():
            self.start()

    def outage(self, seconds: float) -> None:
        """Down for `seconds` (blocking), then up again on the same data folder and port."""
        self.stop()
        time.sleep(seconds)
        self.start()

    def destroy(self) -> None:
        with contextlib.suppress(Exception):
            if self.is_running():
                self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def log_tail(self) -> str:
        return tail(self.log_path)


class FaultRedis(SpareRedis):
    """A private redis-server keeping nothing on disk: a SIGKILL and a restart lose every message."""

    def kill_and_restart_empty(self, down_s: float = 0.0) -> None:
        self.stop()  # SIGKILL
        time.sleep(down_s)
        self.start()

    def ensure_running(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            self.start()

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_connect_timeout=5, socket_timeout=10)

    def flush(self) -> None:
        client = self.client()
        try:
            client.flushall()
        finally:
            client.close()


# --- the store, read by the tests ---------------------------------------------------------------------------


def store_engine(url: str) -> Engine:
    return create_engine(url, pool_pre_ping=True, pool_size=2, max_overflow=2)


def empty_store(db: Engine) -> None:
    """Every row of every table, children first; the `default` tenant (made by the migrations) stays."""
    with db.begin() as conn:
        for table in reversed(Base.metadata.sorted_tables):
            query = table.delete()
            if table.name == Tenant.__tablename__:
                query = query.where(table.c.id != DEFAULT_TENANT)
            conn.execute(query)


class Store:
    """Read-only queries the tests make (plus the webhook subscription each test starts with)."""

    def __init__(self, db: Engine) -> None:
        self.db = db
        self.sessions = sessionmaker(bind=db, expire_on_commit=False)

    def jobs(self, ids: Iterable[str] | None = None) -> dict[str, Job]:
        query = select(Job)
        if ids is not None:
            query = query.where(Job.id.in_(list(ids)))
        with self.sessions() as session:
            return {job.id: job for job in session.execute(query).scalars()}

    def job(self, job_id: str) -> Job:
        found = self.jobs([job_id])
        assert job_id in found, f"job {job_id} is not in the store"
        return found[job_id]

    def workers(self) -> list[Worker]:
        with self.sessions() as session:
            return list(session.execute(select(Worker)).scalars())

    def worker_id_of_pid(self, pid: int) -> str | None:
        for worker in self.workers():
            if worker.pid == pid and worker.stopped_at is None:
                return worker.id
        return None

    def job_deliveries(self) -> dict[str, list[Delivery]]:
        with self.sessions() as session:
            rows = session.execute(select(Delivery).where(Delivery.subject_type == "job")).scalars()
            out: dict[str, list[Delivery]] = {}
            for row in rows:
                out.setdefault(row.subject_id, []).append(row)
        return out

    def subscribe(self, url: str) -> None:
        """One subscription to every job event of the default tenant: each final transition of a job then
        leaves exactly one delivery row, written in the transition's own transaction."""
        from core.clock import utcnow
        from core.store import webhooks

        with self.sessions() as session:
            webhooks.create_subscription(session, DEFAULT_TENANT, url, ["job.*"], "fault suite", utcnow())



def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float, *,
               also: Callable[[], None] | None = None, poll_s: float = POLL_S,
               describe: Callable[[], str] | None = None) -> None:
    """Polls `predicate` (and `also`, which may raise to fail early) until true; AssertionError after
    timeout_s, with what `describe` says of the state then. Database errors count as 'not yet' (a test may
    be waiting for a restarted server)."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while True:
        if also is not None:
            also()
        try:
            if predicate():
                return
            last_error = None
        except AssertionError:
            raise
        except Exception as exc:
            last_error = exc
        if time.monotonic() > deadline:
            detail = f" (last error: {type(last_error).__name__}: {last_error})" if last_error else ""
            if describe is not None:
                detail += f"; now: {describe()}"
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}{detail}")
        time.sleep(poll_s)


# --- processes ----------------------------------------------------------------------------------------------


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"<{path}: {exc}>"
    return "\n".join(text.splitlines()[-lines:])


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
    program = "import sys; from cli.main import app; sys.argv[0] = 'conveyor'; app()"
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


# --- traffic ------------------------------------------------------------------------------------------------

RETRY_STATUSES = {429, 500, 502, 503, 504}


@dataclass
class Submission:
    key: str
    body: dict[str, Any]
    codes: list[int | str] = field(default_factory=list)  # every answer: an HTTP status or an error name
    job_id: str | None = None
    accepted_code: int | None = None  # 202 (created) or 200 (a replay of the same key)
    refusal: Any = None  # the body of a final 4xx
    gave_up: bool = False


class Traffic:
    """Submits jobs at a steady rate from a few threads, each with its own Idempotency-Key. A submission is
    retried with the same key until the API accepts it (2xx) when the answer was lost (connection error,
    timeout) or the service could not take it (429, 5xx), for at most `retry_for_s`."""

    def __init__(self, base_url: str, *, rate: float, body: Callable[[int], dict[str, Any]] | None = None,
                 concurrency: int = 8, retry_for_s: float = 180.0, prefix: str = "t") -> None:
        self.base_url = base_url
        self.rate = rate
        self.body = body or (lambda i: short_job(f"job {i}"))
        self.concurrency = concurrency
        self.retry_for_s = retry_for_s
        self.prefix = prefix
        self.submissions: list[Submission] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._abort = threading.Event()  # set at teardown: retrying submissions give up at once
        self._slots = threading.Semaphore(concurrency)
        self._threads: list[threading.Thread] = []
        self._pacer: threading.Thread | None = None
        self._http = httpx.Client(timeout=httpx.Timeout(10.0, connect=2.0))

    # one submission, retried with its key until accepted ------------------------------------------------

    def submit(self, body: dict[str, Any], key: str | None = None) -> Submission:
        sub = Submission(key or f"{self.prefix}-{uuid.uuid4().hex}", body)
        with self._lock:
            self.submissions.append(sub)
        self._run(sub)
        return sub

    def _run(self, sub: Submission) -> None:
        deadline = time.monotonic() + self.retry_for_s
        pause = 0.2
        while not self._abort.is_set():
            try:
                response = self._http.post(f"{self.base_url}/v1/jobs", json=sub.body,
                                           headers={"Idempotency-Key": sub.key})
            except httpx.HTTPError as exc:  # the request or its answer was lost: retry with the same key
                sub.codes.append(type(exc).__name__)
            else:
                sub.codes.append(response.status_code)
                if response.status_code in (200, 202):
                    sub.job_id = response.json()["id"]
                    sub.accepted_code = response.status_code
                    return
                if response.status_code not in RETRY_STATUSES:
                    sub.gave_up = True  # a 4xx: the test decides what that means
                    with contextlib.suppress(ValueError):
                        sub.refusal = response.json()
                    return
            if time.monotonic() > deadline:
                sub.gave_up = True
                return
            self._abort.wait(pause)
            pause = min(pause * 1.5, 1.0)
        sub.gave_up = True

    # steady traffic --------------------------------------------------------------------------------------

    def start(self) -> Traffic:
        self._pacer = threading.Thread(target=self._pace, name="traffic", daemon=True)
        self._pacer.start()
        return self

    def _pace(self) -> None:
        interval = 1.0 / self.rate
        next_at = time.monotonic()
        i = 0
        while not self._stop.is_set():
            delay = next_at - time.monotonic()
            if delay > 0 and self._stop.wait(delay):
                break
            self._slots.acquire()  # at most `concurrency` submissions in flight (retrying ones included)
            if self._stop.is_set():
                self._slots.release()
                break
            body = self.body(i)
            i += 1
            thread = threading.Thread(target=self._one, args=(body,), daemon=True)
            self._threads.append(thread)
            thread.start()
            next_at = max(next_at + interval, time.monotonic() - 1.0)  # no burst to catch up after a stall

    def _one(self, body: dict[str, Any]) -> None:
        try:
            self.submit(body)
        finally:
            self._slots.release()

    def stop(self, wait_s: float = 240.0) -> Traffic:
        """Stops submitting new jobs and waits for the ones in flight (still retrying) to settle."""
        self._stop.set()
        if self._pacer is not None:
            self._pacer.join(timeout=10)
        deadline = time.monotonic() + wait_s
        for thread in list(self._threads):
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        print(self.summary())  # shown with a failed test's captured output
        return self

    def close(self) -> None:
        """Stops everything at once (teardown): no submission of this traffic may reach the next test."""
        self._stop.set()
        self._abort.set()
        if self._pacer is not None:
            self._pacer.join(timeout=10)
        for thread in list(self._threads):
            thread.join(timeout=15)
        self._http.close()

    # waits on what the traffic has done, instead of fixed sleeps -----------------------------------------

    def wait_submitted(self, n: int, timeout_s: float = 60.0) -> None:
        """Waits until `n` more submissions were made than when called: the traffic went on for a while."""
        target = self._count(lambda s: True) + n
        wait_until(lambda: self._count(lambda s: True) >= target,
                   f"{n} more submissions of traffic {self.prefix}", timeout_s)

    def wait_accepted(self, n: int, timeout_s: float = 60.0) -> None:
        """Waits until `n` more submissions were accepted than when called: the service takes jobs."""
        target = self._count(lambda s: s.job_id is not None) + n
        wait_until(lambda: self._count(lambda s: s.job_id is not None) >= target,
                   f"{n} more accepted submissions of traffic {self.prefix}", timeout_s)

    def wait_lost_answer(self, timeout_s: float = 30.0) -> None:
        """Waits until some submission's answer was lost (a connection error, retried with its key)."""
        wait_until(lambda: self._count(lambda s: any(isinstance(c, str) for c in s.codes)) > 0,
                   f"a lost answer in traffic {self.prefix}", timeout_s)

    def _count(self, counted: Callable[[Submission], bool]) -> int:
        with self._lock:
            return sum(1 for s in self.submissions if counted(s))

    # what happened ---------------------------------------------------------------------------------------

    def accepted(self) -> dict[str, str]:
        """Idempotency-Key -> job id of every accepted submission."""
        with self._lock:
            return {s.key: s.job_id for s in self.submissions if s.job_id is not None}

    def answers(self) -> Counter[int | str]:
        with self._lock:
            return Counter(code for s in self.submissions for code in s.codes)

    def unsettled(self) -> list[Submission]:
        with self._lock:
            return [s for s in self.submissions if s.job_id is None]

    def summary(self) -> str:
        """One line for the test's captured output: how much traffic there was and what it was answered."""
        with self._lock:
            n, accepted = len(self.submissions), sum(1 for s in self.submissions if s.job_id)
            replays = sum(1 for s in self.submissions if s.accepted_code == 200)
        return (f"traffic {self.prefix}: {n} submitted, {accepted} accepted ({replays} replays): "
                f"{self.answers()}")


def short_job(prompt: str, max_tokens: int = 8, **fields: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields}


def long_job(prompt: str, max_tokens: int, **fields: Any) -> dict[str, Any]:
    """A job that generates exactly max_tokens tokens (EOS ignored): long enough to be caught running."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **fields}


# --- the central assertion ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    jobs: dict[str, Job]
    deliveries: dict[str, list[Delivery]]


def describe(job: Job) -> str:
    return (f"{job.id} status={job.status} attempts={job.attempts} worker={job.worker_id} "
            f"error={job.error_code}:{(job.error_message or '')[:160]!r} dispatched_at={job.dispatched_at} "
            f"created_at={job.created_at} started_at={job.started_at} finished_at={job.finished_at}")


def wait_final(store: Store, job_ids: Iterable[str], timeout_s: float, what: str = "") -> dict[str, Job]:
    """Waits until every job is in a final state; the AssertionError lists those that are not."""
    ids = set(job_ids)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            rows = store.jobs(ids)
        except Exception:  # the database may still be coming back
            rows = None
        if rows is not None:
            missing = ids - set(rows)
            assert not missing, f"accepted jobs missing from the store (lost): {sorted(missing)[:20]}"
            open_jobs = [job for job in rows.values() if job.status not in TERMINAL_STATUSES]
            if not open_jobs:
                return rows
            if time.monotonic() > deadline:
                listing = "\n  ".join(describe(j) for j in sorted(open_jobs, key=lambda j: j.created_at)[:30])
                raise AssertionError(
                    f"{len(open_jobs)} of {len(ids)} jobs {what}not final {timeout_s:.0f} s later "
                    f"(by status: {Counter(j.status for j in open_jobs)}):\n  {listing}")
        elif time.monotonic() > deadline:
            raise AssertionError(f"the store stayed unreachable for {timeout_s:.0f} s")
        time.sleep(POLL_S)


def wait_generating(store: Store, job_ids: Iterable[str], timeout_s: float = 60.0) -> dict[str, Job]:
    """Waits until every job is running with its first token stored; fails at once if one ended instead."""
    ids = set(job_ids)

    def generating() -> bool:
        rows = store.jobs(ids)
        ended = [describe(j) for j in rows.values() if j.status not in ("queued", "running")]
        assert not ended, f"jobs ended before they could be caught running: {ended}"
        return len(rows) == len(ids) and all(j.status == "running" and j.first_token_at
                                             for j in rows.values())

    wait_until(generating, f"jobs {sorted(ids)} to be generating", timeout_s)
    return store.jobs(ids)


def succeeded_on(store: Store, worker_id: str | None) -> set[str]:
    """Ids of the jobs the store says that worker finished successfully."""
    return {j.id for j in store.jobs().values() if j.status == "succeeded" and j.worker_id == worker_id}


def running_on(store: Store, worker_id: str | None) -> set[str]:
    """Ids of the jobs the store says are running on that worker."""
    return {j.id for j in store.jobs().values() if j.status == "running" and j.worker_id == worker_id}


def check_exactly_once(
    store: Store,
    accepted: dict[str, str],
    *,
    within_s: float,
    expect: dict[str, set[str]] | None = None,
    max_attempts: int | None = None,
    stack: Stack | None = None,
    reruns_allowed: Iterable[str] = (),
) -> Outcome:
    """The guarantee, read from the database once every job has settled:

    - no accepted job is lost, and every job in the store (accepted or not: a submission whose answer was
      lost may still have been stored) reaches a final state within `within_s`;
    - one job per Idempotency-Key, and no job the traffic did not submit;
    - each job ended for the right reason: `succeeded` unless `expect` allows another status for it, and an
      `expired` or an engine failure only where allowed;
    - exactly once: each job has exactly one final-event delivery row (written in the transaction of the
      transition that applied, so a second completion would leave a second one), whose frozen payload
      agrees with the row; attempts <= max_attempts; and no worker computed a second result for it (a
      dropped duplicate in the worker logs) unless the job is in `reruns_allowed`.
    """
    expect = expect or {}
    wait_final(store, accepted.values(), within_s, "accepted ")
    everything = store.jobs()
    rows = wait_final(store, everything, 30.0, "stored ")  # jobs whose submit answer was lost, too
    problems: list[str] = []

    by_key: dict[str | None, list[Job]] = {}
    for job in rows.values():
        by_key.setdefault(job.idempotency_key, []).append(job)
    stray = [j.id for key, js in by_key.items() for j in js if key not in accepted]
    unaccepted_keys = [k for k in by_key if k not in accepted]
    if stray:
        problems.append(f"{len(stray)} stored job(s) the traffic never saw accepted "
                        f"(keys {unaccepted_keys[:10]})")
    for key, job_id in accepted.items():
        if [j.id for j in by_key.get(key, [])] != [job_id]:
            stored = [j.id for j in by_key.get(key, [])]
            problems.append(f"key {key}: accepted as {job_id}, stored as {stored}")

    deliveries = store.job_deliveries()
    for job in rows.values():
        allowed = expect.get(job.id, {"succeeded"})
        if job.status not in allowed:
            problems.append(f"wrong outcome (allowed {sorted(allowed)}): {describe(job)}")
        if job.status in ("succeeded", "failed") and (job.attempts < 1 or job.finished_at is None):
            problems.append(f"finished without an attempt: {describe(job)}")
        if max_attempts is not None and job.attempts > max_attempts:
            problems.append(f"ran {job.attempts} times (at most {max_attempts} expected): {describe(job)}")
        events = deliveries.get(job.id, [])
        if len(events) != 1:
            kinds = [d.event_type for d in events]
            problems.append(f"{len(events)} final-event records {kinds} (exactly 1 expected): "
                            f"{describe(job)}")
        for event in events:
            data = event.payload.get("data", {})
            if event.event_type != f"job.{job.status}" or data.get("status") != job.status:
                problems.append(f"final event {event.event_type} disagrees with the row: {describe(job)}")
            elif (data.get("attempts"), (data.get("result") or {}).get("text")) != (job.attempts,
                                                                                     job.result_text):
                problems.append(f"final event frozen at attempt {data.get('attempts')} disagrees with the "
                                f"row (result overwritten after the final transition?): {describe(job)}")
    if stack is not None:
        allowed_reruns = set(reruns_allowed)
        for job_id, n in stack.dropped_results().items():
            if job_id not in allowed_reruns:
                row = describe(rows[job_id]) if job_id in rows else ""
                problems.append(f"a worker computed {n} extra result(s) for {job_id} that another attempt "
                                f"owned (it ran more than once): {row}")
    assert not problems, f"{len(problems)} exactly-once problem(s) among {len(rows)} jobs:\n  " + "\n  ".join(
        problems[:40])
    return Outcome(rows, deliveries)
