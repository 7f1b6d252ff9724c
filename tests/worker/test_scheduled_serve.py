"""Scheduled jobs across a restart of the one-process service (`conveyor serve`, SQLite): one job due per
second for 30 s, the process SIGKILLed a few seconds in and started again after more jobs fell due. Every job
starts in due order, none before its time, none is lost, and each reaches its final status once (one final
webhook event each). The same check on PostgreSQL and Redis: tests/faults/test_scheduled_faults.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from conveyor.core.clock import utcnow
from conveyor.core.store import webhooks
from conveyor.core.store.migrate import upgrade
from conveyor.core.store.tables import DEFAULT_TENANT, Delivery
from tests.support.fault_store import Store, store_engine
from tests.support.faults import wait_final
from tests.support.scheduled_jobs import check_due_order, submit_one_per_second
from tests.support.serve import START_S, Serve


@pytest.fixture
def serve(tmp_path: Path, demo_model_dir: Path) -> Iterator[Serve]:
    with Serve(tmp_path, demo_model_dir, SCHEDULE_POLL_S="0.2", WEBHOOK_ALLOWLIST='["127.0.0.1"]') as server:
        yield server


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
