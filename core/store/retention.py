"""The retention purge: what a tenant finished longer ago than its retention is deleted, rows and blobs.

A tenant's retention is its own `tenants.retention_days`, else the settings' `retention_days`; None keeps
everything. Older than that, by when each thing ended or was made:
  - jobs in a final status (finished_at), unless an open batch still holds them (its output is not written),
    with their webhook deliveries;
  - ended batches (finished_at), with their lines, jobs, output and error files and deliveries;
  - files (created_at), unless an open batch reads one as its input; their blobs after the commit;
  - webhook deliveries no longer pending (created_at), with their attempts.
Each transaction deletes at most `purge_chunk_rows` rows of one kind (a batch: that many lines), and each
run at most MAX_CHUNKS of each kind per tenant, so a first purge over years of data neither holds long locks
nor stalls its reconciler; the rest goes on the next run. Rows are picked FOR UPDATE SKIP LOCKED (Postgres),
so purges running at once in several workers take disjoint rows and never wait on each other; deleting a row
already gone is a no-op.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import Select, select
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.lifecycle import DELIVERY_PENDING, OPEN_BATCH_STATUSES, TERMINAL_STATUSES
from conveyor.core.settings import Settings
from conveyor.core.store import batches, blobs, files, jobs, webhooks
from conveyor.core.store.tables import Batch, BatchLine, Delivery, File, Job, Tenant

log = logging.getLogger(__name__)

MAX_CHUNKS = 100  # transactions per kind, per tenant, per run


@dataclass
class PurgeReport:
    jobs: int = 0
    batches: int = 0
    files: int = 0
    deliveries: int = 0
    blob_urls: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.jobs + self.batches + self.files + self.deliveries


def retentions(session: Session, default_days: int | None) -> dict[str, int]:
    """Days of retention per tenant that has one (its own, else `default_days`)."""
    rows = session.execute(select(Tenant.id, Tenant.retention_days))
    out = {tenant: days if days is not None else default_days for tenant, days in rows}
    return {tenant: days for tenant, days in out.items() if days is not None}


def purge(sessions: sessionmaker[Session], settings: Settings, now: datetime) -> PurgeReport:
    """One purge run over every tenant with a retention; the blobs of deleted files are removed last."""
    with sessions() as session:
        by_tenant = retentions(session, settings.retention_days)
    report = PurgeReport()
    for tenant, days in by_tenant.items():
        _purge_tenant(sessions, tenant, now - timedelta(days=days), settings.purge_chunk_rows, report)
    for url in report.blob_urls:
        try:
            blobs.delete(settings, url)
        except Exception as exc:  # the row is gone: an orphan blob costs storage, not correctness
            log.warning("purge: could not delete blob %s (%s: %s)", url, type(exc).__name__, exc)
    if report.total:
        log.info(
            "purge: deleted %d job(s), %d batch(es), %d file(s), %d webhook delivery(ies)",
            report.jobs,
            report.batches,
            report.files,
            report.deliveries,
        )
    return report


def _purge_tenant(
    sessions: sessionmaker[Session], tenant: str, cutoff: datetime, chunk_rows: int, report: PurgeReport
) -> None:
    with sessions() as session:
        report.batches += _purge_batches(session, tenant, cutoff, chunk_rows, report.blob_urls)
        report.jobs += _chunks(lambda: _purge_jobs_chunk(session, tenant, cutoff, chunk_rows), chunk_rows)
        report.files += _chunks(
            lambda: _purge_files_chunk(session, tenant, cutoff, chunk_rows, report.blob_urls), chunk_rows
        )
        report.deliveries += _chunks(
            lambda: _purge_deliveries_chunk(session, tenant, cutoff, chunk_rows), chunk_rows
        )


def _chunks(delete_chunk: Callable[[], int], chunk_rows: int) -> int:
    """Runs `delete_chunk` until one deletes less than a full chunk, at most MAX_CHUNKS times."""
    total = 0
    for _ in range(MAX_CHUNKS):
        deleted = delete_chunk()
        total += deleted
        if deleted < chunk_rows:
            break
    return total


def _locked_ids(query: Select[tuple[str]], session: Session) -> list[str]:
    return list(session.execute(query.with_for_update(skip_locked=True)).scalars())


def _purge_jobs_chunk(session: Session, tenant: str, cutoff: datetime, limit: int) -> int:
    held_by_open_batch = (
        select(BatchLine.job_id)
        .join(Batch, Batch.id == BatchLine.batch_id)
        .where(BatchLine.job_id == Job.id, Batch.status.in_(OPEN_BATCH_STATUSES))
        .exists()
    )
    # created_at < cutoff too: finished_at < cutoff implies it, and the (tenant_id, created_at) index helps
    query = (
        select(Job.id)
        .where(
            Job.tenant_id == tenant,
            Job.created_at < cutoff,
            Job.status.in_(TERMINAL_STATUSES),
            Job.finished_at < cutoff,
            ~held_by_open_batch,
        )
        .limit(limit)
    )
    deleted = jobs.delete_rows(session, tenant, _locked_ids(query, session), TERMINAL_STATUSES)
    session.commit()
    return deleted


def _purge_files_chunk(session: Session, tenant: str, cutoff: datetime, limit: int, urls: list[str]) -> int:
    read_by_open_batch = (
        select(Batch.id).where(Batch.input_file_id == File.id, Batch.status.in_(OPEN_BATCH_STATUSES)).exists()
    )
    query = (
        select(File.id)
        .where(File.tenant_id == tenant, File.created_at < cutoff, ~read_by_open_batch)
        .limit(limit)
    )
    deleted = files.delete_rows(session, _locked_ids(query, session))
    session.commit()
    urls += deleted
    return len(deleted)


def _purge_deliveries_chunk(session: Session, tenant: str, cutoff: datetime, limit: int) -> int:
    query = (
        select(Delivery.id)
        .where(
            Delivery.tenant_id == tenant, Delivery.created_at < cutoff, Delivery.status != DELIVERY_PENDING
        )
        .limit(limit)
    )
    deleted = webhooks.delete_deliveries(session, _locked_ids(query, session))
    session.commit()
    return deleted


def _purge_batches(session: Session, tenant: str, cutoff: datetime, chunk_rows: int, urls: list[str]) -> int:
    """Ended batches past the cutoff, each deleted a chunk of lines per transaction; a batch another purge
    holds is skipped (it finishes it)."""
    query = (
        select(Batch.id)
        .where(
            Batch.tenant_id == tenant, Batch.status.not_in(OPEN_BATCH_STATUSES), Batch.finished_at < cutoff
        )
        .limit(chunk_rows)
    )
    done = 0
    budget = MAX_CHUNKS
    for batch_id in list(session.execute(query).scalars()):
        while budget > 0:
            budget -= 1
            step = batches.delete_step(session, batch_id, tenant, chunk_rows, skip_locked=True)
            urls += step.blob_urls
            done += step.done
            if step.done or step.status is None:
                break
        if budget == 0:
            break
    return done
