"""Retry limits: a job whose worker is SIGKILLed on each of its max_attempts (3) runs ends `failed` with
`worker_lost` and attempts = 3, instead of taking down one worker after another forever.

Each "worker" is a small process that does what a worker does with a job before it dies with it: registers,
claims the job (the runner's claim, attempts + 1) and heartbeats, until it is SIGKILLed. The reconciler (the
one every worker runs) then finds it dead after worker_dead_after_s and requeues the job, or fails it once it
has had its attempts. No engine is loaded: the three kills take seconds, not three worker start-ups. Runs on
SQLite and on PostgreSQL (a database of the shared server, emptied; nothing is killed but the holders).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.clock import utcnow
from conveyor.core.lifecycle import FAILED, QUEUED, RUNNING
from conveyor.core.settings import Settings
from conveyor.core.store import jobs
from conveyor.core.store.tables import Job
from conveyor.worker.reconciler import Reconciler
from tests.support.fault_store import WAIT_S
from tests.support.service import RecordingPublisher

pytestmark = pytest.mark.faults

REPO_ROOT = Path(__file__).resolve().parents[2]
HOLDER = """
import os, sys, time
from conveyor.core.clock import utcnow
from conveyor.core.store import jobs, workers
from conveyor.core.store.database import make_db_engine, make_session_factory

url, job_id, worker_id = sys.argv[1:]
sessions = make_session_factory(make_db_engine(url))
with sessions() as session:
    workers.register(session, worker_id, hostname="holder", pid=os.getpid(),
                     queues=["demo-model:interactive"], now=utcnow())
    assert jobs.claim_many(session, [job_id], worker_id, utcnow()), "the job was not claimable"
print("claimed", flush=True)
while True:
    with sessions() as session:
        workers.heartbeat(session, worker_id, utcnow())
    time.sleep(0.1)
"""


class FinishedRecorder:
    def __init__(self) -> None:
        self.job_ids: list[str] = []

    def finished(self, job_ids: list[str]) -> None:
        self.job_ids += job_ids


def _hold_then_sigkill(database_url: str, job_id: str, worker_id: str) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, database_url, job_id, worker_id],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == b"claimed", "the holder could not claim the job"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(WAIT_S)


def _reconcile_until(reconciler: Reconciler, sessions: sessionmaker[Session], job_id: str) -> Job:
    """Reconciler rounds until the job is no longer running (its dead worker noticed); the job then."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        reconciler.run_once()
        with sessions() as session:
            job = jobs.get(session, job_id)
            assert job is not None
            if job.status != RUNNING:
                return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} still running {WAIT_S} s after its worker was killed")


def test_a_job_whose_worker_is_killed_three_times_fails_with_worker_lost(
    session_factory: sessionmaker[Session],
    make_settings: Callable[..., Settings],
    database_url: str,
) -> None:
    settings = make_settings(database_url=database_url, worker_dead_after_s=0.5, max_attempts=3)
    publisher, finished = RecordingPublisher(), FinishedRecorder()
    reconciler = Reconciler(session_factory, publisher, settings, finished=finished)
    with session_factory() as session:
        job_id = jobs.add(
            session,
            jobs.NewJob(
                tenant_id="default",
                queue="demo-model:interactive",
                prompt="poison",
                messages=None,
                params={},
                meta=None,
                webhook=None,
                idempotency_key=None,
                request_hash="x",
                prompt_tokens=1,
                ttl_s=None,
                timeout_s=None,
            ),
            utcnow(),
        ).id

    for kill in (1, 2):
        _hold_then_sigkill(database_url, job_id, f"holder-{kill}")
        job = _reconcile_until(reconciler, session_factory, job_id)
        assert (job.status, job.attempts, job.worker_id) == (QUEUED, kill, None)
        assert (job_id, "demo-model:interactive") in publisher.published  # requeued jobs go out again at once
    _hold_then_sigkill(database_url, job_id, "holder-3")
    job = _reconcile_until(reconciler, session_factory, job_id)

    assert (job.status, job.error_code, job.attempts, job.retries) == (FAILED, "worker_lost", 3, 2)
    assert job.finished_at is not None and "max_attempts (3)" in (job.error_message or "")
    assert finished.job_ids == [job_id]  # long polls and event streams hear of it
