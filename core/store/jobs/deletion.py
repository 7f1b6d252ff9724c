"""Deleting jobs: a tenant's finished job on request, and the rows of a purge."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from conveyor.core.lifecycle import OPEN_BATCH_STATUSES, SCHEDULED, TERMINAL_STATUSES
from conveyor.core.store import webhooks
from conveyor.core.store.tables import Batch, BatchLine, Job


@dataclass(frozen=True)
class JobDeletion:
    """What DELETE found: no such job (`status` None), a job still queued or running (not deleted), one an
    open batch still holds (`open_batch_id`, not deleted), or a final job now deleted."""

    status: str | None
    deleted: bool = False
    open_batch_id: str | None = None


DELETABLE_STATUSES = (SCHEDULED, *TERMINAL_STATUSES)  # a scheduled job has not started: nothing runs it


def delete_finished(session: Session, job_id: str, tenant_id: str) -> JobDeletion:
    """Deletes the tenant's job, once final and no open batch holds it, with its webhook deliveries, in one
    transaction; commits. The DELETE is conditional on a final status, so a job that a worker is still
    running is never deleted under it."""
    status = session.execute(
        select(Job.status).where(Job.id == job_id, Job.tenant_id == tenant_id).with_for_update()
    ).scalar_one_or_none()
    if status is None or status not in DELETABLE_STATUSES:
        session.rollback()
        return JobDeletion(status)
    batch_id = open_batch_of(session, job_id)
    if batch_id is not None:
        session.rollback()
        return JobDeletion(status, open_batch_id=batch_id)
    deleted = delete_rows(session, tenant_id, [job_id], DELETABLE_STATUSES)
    session.commit()
    return JobDeletion(status, deleted=deleted == 1)


def open_batch_of(session: Session, job_id: str) -> str | None:
    """The batch still running that holds this job (its output is not written yet), or None."""
    query = (select(BatchLine.batch_id).join(Batch, Batch.id == BatchLine.batch_id)
             .where(BatchLine.job_id == job_id, Batch.status.in_(OPEN_BATCH_STATUSES)).limit(1))
    return session.execute(query).scalar_one_or_none()


def delete_rows(session: Session, tenant_id: str, job_ids: list[str],
                statuses: tuple[str, ...] | None = None) -> int:
    """Deletes the tenant's jobs of `job_ids` (only those in `statuses` when given) and the webhook
    deliveries about them; no commit. Returns how many jobs went."""
    if not job_ids:
        return 0
    webhooks.delete_for_subjects(session, tenant_id, "job", job_ids)
    statement = delete(Job).where(Job.id.in_(job_ids), Job.tenant_id == tenant_id)
    if statuses is not None:
        statement = statement.where(Job.status.in_(statuses))
    result = session.execute(statement.execution_options(synchronize_session=False))
    return int(result.rowcount)  # type: ignore[attr-defined]
