"""Rows for the deletion and retention tests, written straight into the store: finished jobs, ended batches
with lines, jobs and output files, uploaded files with their blobs, and webhook deliveries with an attempt.
Each takes the times it should look its age by."""

from __future__ import annotations

import io
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from conveyor.core.lifecycle import COMPLETED, DELIVERY_DELIVERED, LINE_SUCCEEDED, SUCCEEDED
from conveyor.core.settings import Settings
from conveyor.core.store import batches, blobs, files, jobs, keys, webhooks
from conveyor.core.store.tables import Attempt, Batch, BatchLine, Delivery, File, Job


def count(session: Session, table: type, *conditions: object) -> int:
    return int(session.execute(select(func.count()).select_from(table).where(*conditions)).scalar_one())


def finished_job(session: Session, tenant: str, finished_at: datetime, status: str = SUCCEEDED) -> str:
    """A job with a prompt, a result and logprobs, created and finished at `finished_at`."""
    keys.ensure_tenant(session, tenant, finished_at)
    job = jobs.add(
        session,
        jobs.NewJob(
            tenant_id=tenant,
            queue="demo-model:interactive",
            prompt="a secret prompt",
            messages=None,
            params={},
            meta=None,
            webhook=None,
            idempotency_key=None,
            request_hash="x",
            prompt_tokens=3,
            ttl_s=None,
            timeout_s=None,
        ),
        finished_at,
    )
    session.execute(
        update(Job)
        .where(Job.id == job.id)
        .values(
            status=status,
            result_text="a secret result",
            logprobs=[{"token_id": 1, "logprob": -0.5}],
            finished_at=finished_at,
            attempts=1,
        )
    )
    session.commit()
    return job.id


def delivery(
    session: Session,
    tenant: str,
    subject_type: str,
    subject_id: str,
    at: datetime,
    status: str = DELIVERY_DELIVERED,
) -> str:
    """A delivery about the subject, with one attempt."""
    row = webhooks.add_delivery(
        session,
        tenant_id=tenant,
        subscription_id=None,
        url="https://hooks.test/",
        event={"type": f"{subject_type}.done"},
        subject_type=subject_type,
        subject_id=subject_id,
        now=at,
    )
    row.status = status
    session.flush()
    session.add(
        Attempt(
            delivery_id=row.id,
            number=1,
            attempted_at=at,
            outcome="delivered",
            status_code=200,
            duration_s=0.1,
        )
    )
    session.commit()
    return row.id


def stored_file(
    session: Session, settings: Settings, tenant: str, at: datetime, purpose: str = files.BATCH
) -> File:
    """A file row and its blob (where settings put uploads)."""
    file_id = files.new_file_id()
    url = blobs.blob_url(settings, file_id)
    blobs.save(settings, url, io.BytesIO(b'{"custom_id": "a"}\n'))
    row = File(
        id=file_id, tenant_id=tenant, purpose=purpose, filename="f.jsonl", bytes=19, url=url, created_at=at
    )
    files.add(session, row)
    session.commit()
    return row


@dataclass(frozen=True)
class SeededBatch:
    id: str
    job_ids: list[str]
    output: File
    error: File


def ended_batch(
    session: Session,
    settings: Settings,
    tenant: str,
    finished_at: datetime,
    lines: int = 2,
    status: str = COMPLETED,
) -> SeededBatch:
    """A batch (uploaded-file form) ended at `finished_at`, with `lines` lines and jobs, output and error
    files, and a delivery about it."""
    batch = batches.create(
        session, tenant_id=tenant, input_url="unused", output_url=None, queue="interactive", now=finished_at
    )
    job_ids = [finished_job(session, tenant, finished_at) for _ in range(lines)]
    session.add_all(
        [
            BatchLine(batch_id=batch.id, line=i + 1, custom_id=f"c{i}", status=LINE_SUCCEEDED, job_id=job_id)
            for i, job_id in enumerate(job_ids)
        ]
    )
    output = stored_file(session, settings, tenant, finished_at, files.BATCH_OUTPUT)
    error = stored_file(session, settings, tenant, finished_at, files.BATCH_OUTPUT)
    session.execute(
        update(Batch)
        .where(Batch.id == batch.id)
        .values(status=status, finished_at=finished_at, output_file_id=output.id, error_file_id=error.id)
    )
    session.commit()
    delivery(session, tenant, "batch", batch.id, finished_at)
    return SeededBatch(batch.id, job_ids, output, error)


def deliveries_of(session: Session, subject_ids: list[str]) -> int:
    return count(session, Delivery, Delivery.subject_id.in_(subject_ids))


def attempts_of(session: Session, delivery_ids: list[str]) -> int:
    return count(session, Attempt, Attempt.delivery_id.in_(delivery_ids))
