"""The retention purge deletes what is older than each tenant's retention (its own, else the settings'
default), and nothing younger, nothing of a tenant without one, and nothing an open batch still needs; in
chunks of purge_chunk_rows; two purges at once delete each row once. Runs on SQLite and on PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from threading import Thread

from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.clock import utcnow
from conveyor.core.lifecycle import IN_PROGRESS
from conveyor.core.settings import Settings
from conveyor.core.store import keys, retention
from conveyor.core.store.tables import Attempt, Batch, BatchLine, Delivery, File, Job, Tenant
from tests.support.deletion import count, deliveries_of, delivery, ended_batch, finished_job, stored_file


def _retention_days(session: Session, tenant: str, days: int | None) -> None:
    keys.ensure_tenant(session, tenant, utcnow())
    session.execute(update(Tenant).where(Tenant.id == tenant).values(retention_days=days))
    session.commit()


def test_purge_deletes_only_what_is_older_than_the_tenants_retention(
    session_factory: sessionmaker[Session],
    make_settings: Callable[..., Settings],
    database_url: str,
) -> None:
    settings = make_settings(database_url=database_url, retention_days=30, purge_chunk_rows=2)
    now = utcnow()
    old, recent, ancient = now - timedelta(days=10), now - timedelta(days=5), now - timedelta(days=400)
    with session_factory() as session:
        _retention_days(session, "alice", 7)  # her own: 7 days; bob and carol: the default
        _retention_days(session, "bob", None)
        old_jobs = [finished_job(session, "alice", old) for _ in range(5)]  # more than one chunk
        kept_jobs = [finished_job(session, "alice", recent), finished_job(session, "bob", old)]
        old_delivery = delivery(session, "alice", "job", kept_jobs[0], old)
        kept_pending = delivery(session, "alice", "job", kept_jobs[0], old, status="pending")
        old_file = stored_file(session, settings, "alice", old)
        kept_file = stored_file(session, settings, "alice", recent)
        old_batch = ended_batch(session, settings, "alice", old, lines=3)
        open_batch = ended_batch(session, settings, "alice", old, lines=1)
        session.execute(update(Batch).where(Batch.id == open_batch.id).values(status=IN_PROGRESS))
        session.commit()
        carol_job = finished_job(session, "carol", ancient)
    settings_without_default = make_settings(database_url=database_url, retention_days=None)

    retention.purge(session_factory, settings_without_default, now)  # alice: her own; bob and carol: none
    with session_factory() as session:
        assert count(session, Job, Job.id.in_(old_jobs)) == 0
        assert count(session, Job, Job.id.in_([*kept_jobs, carol_job])) == 3
    retention.purge(session_factory, settings, now)  # the default (30 days) for bob and carol

    with session_factory() as session:
        assert (
            count(session, Job, Job.id.in_(kept_jobs)) == 2 and count(session, Job, Job.id == carol_job) == 0
        )
        assert count(session, Delivery, Delivery.id == old_delivery) == 0
        assert count(session, Attempt, Attempt.delivery_id == old_delivery) == 0
        assert count(session, Delivery, Delivery.id == kept_pending) == 1  # still being delivered
        assert count(session, File, File.id.in_([old_file.id, old_batch.output.id, old_batch.error.id])) == 0
        assert not Path(old_file.url).exists() and not Path(old_batch.output.url).exists()
        assert count(session, File, File.id == kept_file.id) == 1 and Path(kept_file.url).exists()
        assert count(session, Batch, Batch.id == old_batch.id) == 0
        assert count(session, BatchLine, BatchLine.batch_id == old_batch.id) == 0
        assert count(session, Job, Job.id.in_(old_batch.job_ids)) == 0
        assert deliveries_of(session, [old_batch.id]) == 0
        # An open batch keeps its jobs and lines, whatever their age, until it has ended.
        assert count(session, Batch, Batch.id == open_batch.id) == 1
        assert count(session, Job, Job.id.in_(open_batch.job_ids)) == 1


def test_two_purges_at_once_delete_each_row_once(
    session_factory: sessionmaker[Session],
    make_settings: Callable[..., Settings],
    database_url: str,
) -> None:
    settings = make_settings(database_url=database_url, retention_days=1, purge_chunk_rows=3)
    old = utcnow() - timedelta(days=2)
    with session_factory() as session:
        job_ids = [finished_job(session, "alice", old) for _ in range(12)]
        batch = ended_batch(session, settings, "alice", old, lines=4)
    reports: list[retention.PurgeReport] = []
    purgers = [
        Thread(target=lambda: reports.append(retention.purge(session_factory, settings, utcnow())))
        for _ in range(2)
    ]
    for purger in purgers:
        purger.start()
    for purger in purgers:
        purger.join()
    retention.purge(session_factory, settings, utcnow())  # what a skipped (locked) row left for later
    with session_factory() as session:
        assert count(session, Job, Job.id.in_([*job_ids, *batch.job_ids])) == 0
        assert count(session, Batch, Batch.id == batch.id) == 0
    assert sum(r.batches for r in reports) <= 1
    assert sum(r.files for r in reports) <= 2  # the batch's output and error files, each deleted once
