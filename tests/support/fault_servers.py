"""The fault suite's own PostgreSQL cluster and redis-server, which its tests stop, kill and restart: never
the shared services on 5432/6379.

FaultPostgres: a private cluster (initdb/pg_ctl into a temporary folder, run as the `postgres` user when we
are root) on a free loopback port, which a test may stop and start again on the same data. FaultRedis: a
redis-server a test may kill and bring back empty.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from tests.support.live_server import SpareRedis, free_port

PG_BIN_GLOB = "/usr/lib/postgresql/*/bin"
PG_BIN_ENV = "CONVEYOR_TEST_PG_BIN"  # a folder holding initdb and pg_ctl, when not under PG_BIN_GLOB
LOG_TAIL_LINES = 120


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

def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"<{path}: {exc}>"
    return "\n".join(text.splitlines()[-lines:])
