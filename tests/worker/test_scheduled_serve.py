"""Scheduled jobs across a restart of the one-process service (`conveyor serve`, SQLite): one job due per
second for 30 s, the process SIGKILLed a few seconds in and started again after more jobs fell due. Every job
starts in due order, none before its time, none is lost, and each reaches its final status once (one final
webhook event each). The same check on PostgreSQL and Redis: tests/faults/test_scheduled_faults.py."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from core.clock import utcnow
from core.store import webhooks
from core.store.migrate import upgrade
from core.store.tables import DEFAULT_TENANT, Delivery
from tests.support.fault_stack import REPO_ROOT, conveyor_command
from tests.support.fault_store import Store, store_engine
from tests.support.faults import wait_final
from tests.support.live_server import free_port, wait_for
from tests.support.scheduled_jobs import check_due_order, submit_one_per_second

START_S = 180.0  # a hang guard for a model load on a busy machine


class Serve:
    """`conveyor serve` on one SQLite file, started (and killed) as often as a test likes."""

    def __init__(self, tmp: Path, model_dir: Path) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self.database_url = f"sqlite:///{tmp / 'conveyor.db'}"
        self.log = tmp / "serve.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
        env.update({f"CONVEYOR_{k}": v for k, v in {
            "DATA_DIR": str(tmp / "data"), "DATABASE_URL": self.database_url, "MODEL": str(model_dir),
            "AUTH_ENABLED": "false", "NUM_THREADS": "1", "SCHEDULE_POLL_S": "0.2",
            "RECONCILE_INTERVAL_S": "0.5", "DISPATCH_GRACE_S": "1", "WORKER_HEARTBEAT_S": "0.5",
            "WORKER_DEAD_AFTER_S": "4",
            "WEBHOOK_ALLOWLIST": '["127.0.0.1"]'}.items()})
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

    def _answers(self) -> bool:
        assert self.proc is not None
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        try:
            return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False


@pytest.fixture
def serve(tmp_path: Path, demo_model_dir: Path) -> Iterator[Serve]:
    server = Serve(tmp_path, demo_model_dir)
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(30)


def test_scheduled_jobs_start_in_due_order_across_a_restart(serve: Serve) -> None:
    upgrade(serve.database_url)
    store = Store(store_engine(serve.database_url))
    with store.sessions() as session:  # every final transition leaves one delivery row: "exactly once"
        webhooks.create_subscription(session, DEFAULT_TENANT, "http://127.0.0.1:9/hook", ["job.*"], "test",
                                     utcnow())
    serve.start()
    accepted, first_due = submit_one_per_second(serve.url, "serve")
    time.sleep(max(0.0, (first_due - utcnow()).total_seconds()) + 6.5)  # some jobs have run

    serve.kill()
    reran = {job.id for job in store.jobs(accepted.values()).values() if job.status == "running"}
    time.sleep(4.0)  # more jobs fall due while nothing runs: they wait, scheduled
    serve.start()

    rows = wait_final(store, accepted.values(), START_S)
    check_due_order(rows, accepted, reran)
    assert all(job.attempts == 1 for job in rows.values() if job.id not in reran)
    with store.sessions() as session:
        finals = session.execute(select(Delivery.subject_id).where(Delivery.subject_type == "job")).scalars()
        counted = sorted(finals)
    assert counted == sorted(accepted.values()), "one final event per job"
