"""Helpers for the worker tests: jobs through the store, polling, and `python -m conveyor.worker`
subprocesses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.clock import utcnow
from conveyor.core.lanes import lane_of
from conveyor.core.store import jobs
from conveyor.core.store.tables import Job
from tests.support.fault_store import WAIT_S
from tests.support.live_server import wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
TEST_MODEL = "demo-model"  # the id of the tests' tiny models (their folders' name)
LONG_JOB_TOKENS = 2000  # long enough to be caught running on the tiny model (a few ms per token on CPU)


def add_job(
    sessions: sessionmaker[Session],
    prompt: str | None = "The queue holds jobs",
    queue: str = "interactive",
    *,
    messages: list[dict[str, str]] | None = None,
    timeout_s: float | None = None,
    ttl_s: float | None = None,
    tenant_id: str = "default",
    priority: int = 0,
    deadline_s: float | None = None,
    run_at: datetime | None = None,
    max_retries: int | None = None,
    **params: Any,
) -> str:
    """Inserts a queued job as the API would (without publishing it) and returns its id. `queue`: a lane,
    or a queue of TEST_MODEL."""
    params = {"temperature": 0.0, **params}
    new = jobs.NewJob(
        tenant_id=tenant_id, queue=lane(queue), prompt=None if messages else prompt, messages=messages,
        params=params, meta=None, webhook=None, idempotency_key=None, request_hash="test", prompt_tokens=0,
        ttl_s=ttl_s, timeout_s=timeout_s, priority=priority, deadline_s=deadline_s, run_at=run_at,
        max_retries=max_retries,
    )
    with sessions() as session:
        return jobs.add(session, new, utcnow()).id


def lane(queue: str) -> str:
    """`queue` as a lane (core/lanes.py): as given when it is one, else TEST_MODEL's."""
    return queue if ":" in queue else lane_of(TEST_MODEL, queue)


def get_job(sessions: sessionmaker[Session], job_id: str) -> Job:
    with sessions() as session:
        job = jobs.get(session, job_id)
    assert job is not None, job_id
    return job


def wait_finished(sessions: sessionmaker[Session], job_ids: list[str], timeout_s: float = WAIT_S,
                  ) -> list[Job]:
    def done() -> bool:
        return all(get_job(sessions, i).status not in ("queued", "running") for i in job_ids)

    wait_for(done, f"jobs {job_ids} to finish", timeout_s=timeout_s)
    return [get_job(sessions, i) for i in job_ids]


def wait_generating(sessions: sessionmaker[Session], job_id: str, timeout_s: float = WAIT_S) -> Job:
    """Waits until the job is running and has its first token; fails at once if it ended instead."""

    def started() -> bool:
        job = get_job(sessions, job_id)
        assert job.status in ("queued", "running"), (job.status, job.error_code, job.error_message)
        return job.first_token_at is not None

    wait_for(started, f"job {job_id} to start generating", timeout_s=timeout_s)
    return get_job(sessions, job_id)


def worker_env(
    database_url: str, broker_url: str, model_dir: Path, data_dir: Path, **settings: str
) -> dict[str, str]:
    """Environment for `python -m conveyor.worker`: CONVEYOR_* settings (nested with __), fast reconciler
    timings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    values = {
        "DATABASE_URL": database_url, "BROKER_URL": broker_url, "MODEL": str(model_dir),
        "DATA_DIR": str(data_dir),
        "RECONCILE_INTERVAL_S": "0.2", "DISPATCH_GRACE_S": "0.5", "WORKER_HEARTBEAT_S": "0.2",
        "WORKER_DEAD_AFTER_S": "2", "CANCEL_POLL_S": "0.1", "MAX_NUM_SEQS": "16", "NUM_KV_BLOCKS": "1024",
        "NUM_THREADS": "1", **settings,
    }
    env.update({f"CONVEYOR_{k.upper()}": v for k, v in values.items()})
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    # One thread each, as the fault suite's processes: on a machine the parallel suite keeps busy, an op split
    # over two threads waits at torch's barrier for whichever one is not running.
    env["OMP_NUM_THREADS"] = "1"
    return env


class WorkerProcesses:
    """Starts `python -m conveyor.worker` subprocesses; every one still alive is SIGKILLed at teardown."""

    def __init__(self, log_dir: Path) -> None:
        self._log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = open(self._log_dir / f"worker-{len(self.procs)}.log", "wb")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen([sys.executable, "-m", "conveyor.worker"], env=env, cwd=REPO_ROOT, stdout=log,
                                stderr=subprocess.STDOUT)
        log.close()
        self.procs.append(proc)
        return proc

    def log(self, index: int) -> str:
        return (self._log_dir / f"worker-{index}.log").read_text(errors="replace")

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
