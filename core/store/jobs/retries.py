"""failed | cancelled | expired -> queued again under the same id, on request (POST /v1/jobs/{id}/retry)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from conveyor.core.lifecycle import QUEUED, RETRYABLE_STATUSES, SCHEDULED
from conveyor.core.store.jobs.deletion import open_batch_of
from conveyor.core.store.jobs.history import outcome_entry, with_entry
from conveyor.core.store.jobs.reads import get
from conveyor.core.store.jobs.transitions import conditional_update
from conveyor.core.store.tables import Job


@dataclass(frozen=True)
class RetryResult:
    """What POST /v1/jobs/{id}/retry found: no such job (`job` None), a job run again by this call
    (`applied`), a replay of an Idempotency-Key an earlier retry used (`replayed`), one an open batch still
    holds (`open_batch_id`), or one not failed, cancelled or expired (none of the flags)."""

    job: Job | None
    applied: bool = False
    replayed: bool = False
    open_batch_id: str | None = None


_RESULT_FIELDS = ("result_text", "finish_reason", "completion_tokens", "cached_tokens", "draft_tokens",
                  "accepted_draft_tokens", "logprobs", "choices", "prompt_logprobs", "embeddings",
                  "error_code", "error_message", "started_at", "first_token_at", "finished_at", "worker_id",
                  "dispatched_at", "predicted_finish_at")


def retry(session: Session, job_id: str, tenant_id: str, now: datetime, *, key: str | None = None,
          run_at: datetime | None = None) -> RetryResult:
    """failed|cancelled|expired -> queued (scheduled when `run_at` is ahead) under the same id: its outcome
    goes into its history, its result and error are cleared, its retries (core/retry_policy.py) start over,
    and its ttl and deadline count from now (or run_at). `key`: an Idempotency-Key; a retry that used it
    already makes this a replay. Committed."""
    query = select(Job).where(Job.id == job_id, Job.tenant_id == tenant_id).with_for_update()
    job = session.execute(query.execution_options(populate_existing=True)).scalar_one_or_none()
    replayed = job is not None and used_retry_key(job, key)
    if job is None or job.status not in RETRYABLE_STATUSES or replayed:
        session.rollback()
        return RetryResult(job, replayed=replayed)
    batch_id = open_batch_of(session, job_id)
    if batch_id is not None:
        session.rollback()
        return RetryResult(job, open_batch_id=batch_id)
    scheduled = run_at is not None and run_at > now
    since = run_at if run_at is not None and scheduled else now
    entry = outcome_entry(job) | ({"retry_key": key} if key is not None else {})
    values: dict[str, Any] = dict.fromkeys(_RESULT_FIELDS)
    values.update(status=SCHEDULED if scheduled else QUEUED, run_at=since,
                  history=with_entry(job, entry), retries=0, updated_at=now,
                  expires_at=since + timedelta(seconds=job.ttl_s) if job.ttl_s is not None else None)
    if job.deadline_at is not None:  # as far after the new start as it was after the old one
        ahead = job.deadline_at - (job.run_at or job.created_at)
        values["deadline_at"] = values["start_by"] = since + ahead
    # NOTE: the row as read, not only its status: SQLite takes no row lock on the read, and another retry
    # and cancel in between would bring the status back to what was read, under a longer history.
    unchanged = Job.updated_at == job.updated_at
    applied = conditional_update(session, job.id, (job.status,), unchanged, **values)
    session.commit()
    return RetryResult(get(session, job_id, tenant_id), applied=applied)


def used_retry_key(job: Job, key: str | None) -> bool:
    """Whether a retry of the job already used this Idempotency-Key."""
    return key is not None and any(entry.get("retry_key") == key for entry in job.history or [])
