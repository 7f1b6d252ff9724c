"""The reconciler's periodic duties beside recovery (Postgres): its loop runs the retention purge (the
embedded service and every worker run this loop), and prunes the rows of workers dead for longer than
worker_prune_after_s, never one that still holds a running job."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.clock import utcnow
from conveyor.core.store import jobs, workers
from conveyor.core.store.tables import Job, Worker
from conveyor.worker.reconciler import Reconciler
from tests.support.deletion import count, finished_job
from tests.support.live_server import wait_for
from tests.support.service import RecordingPublisher
from tests.support.worker import add_job


def _worker(sessions: sessionmaker[Session], worker_id: str, last_seen_ago_s: float) -> None:
    with sessions() as session:
        workers.register(session, worker_id, hostname="h", pid=1, queues=["interactive"], now=utcnow())
        seen = utcnow() - timedelta(seconds=last_seen_ago_s)
        session.execute(update(Worker).where(Worker.id == worker_id).values(last_seen_at=seen))
        session.commit()


def test_the_reconcile_loop_purges_and_prunes(
    sessions: sessionmaker[Session], make_settings: Callable[..., Any], pg_url: str
) -> None:
    settings = make_settings(
        database_url=pg_url, retention_days=1, worker_prune_after_s=3600, worker_dead_after_s=7200
    )
    with sessions() as session:
        old_job = finished_job(session, "default", utcnow() - timedelta(days=2))
        new_job = finished_job(session, "default", utcnow())
    _worker(sessions, "long-gone", last_seen_ago_s=7200)
    _worker(sessions, "gone-with-a-job", last_seen_ago_s=4000)  # past the prune age, not yet dead
    _worker(sessions, "alive", last_seen_ago_s=0)
    held = add_job(sessions)
    with sessions() as session:
        assert jobs.claim(session, held, "gone-with-a-job", utcnow()) is not None

    reconciler = Reconciler(sessions, RecordingPublisher(), settings)
    reconciler.start()
    try:

        def purged() -> bool:
            with sessions() as session:
                return count(session, Job, Job.id == old_job) == 0

        wait_for(purged, "the reconcile loop to purge the old job")
    finally:
        reconciler.stop()
    with sessions() as session:
        assert count(session, Job, Job.id == new_job) == 1
        remaining = set(session.execute(Worker.__table__.select().with_only_columns(Worker.id)).scalars())
    assert remaining == {"gone-with-a-job", "alive"}
