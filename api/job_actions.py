"""What a client or an operator does to one job, for the API's routes and the console alike: cancel it
(its waiters woken), or run it again under its id (admitted as a submission is, then published unless it
waits for a later time)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session

from conveyor.api.deps import Services
from conveyor.api.errors import ApiError, not_found
from conveyor.api.submit import admit_retry
from conveyor.core.clock import utcnow
from conveyor.core.lifecycle import CANCELLED, QUEUED, RETRYABLE_STATUSES
from conveyor.core.store import jobs
from conveyor.core.store.tables import Job


def cancel(session: Session, services: Services, tenant: str, job_id: str) -> Job:
    """The job, cancelled now (404 when the tenant has none, 409 when it had already ended); committed, its
    waiters here and in other API processes are woken."""
    job = jobs.cancel(session, job_id, tenant, utcnow())
    if job is None:
        raise not_found("job", job_id)
    if job.status != CANCELLED:
        raise ApiError(409, "not_cancellable", f"id: job {job_id} already {job.status}", "id")
    if services.finished is not None:
        services.finished.finished([job.id])
    return job


def retry(session: Session, services: Services, tenant: str, job_id: str, now: datetime, *,
          key: str | None = None, run_at: datetime | None = None) -> tuple[Job, bool]:
    """(the job, replayed): replayed when `key` was used by an earlier retry of it (nothing changed). What
    the store refused is an ApiError: 404, 409 not_retryable, or admission's 429."""
    found = jobs.get(session, job_id, tenant)
    if found is None:
        raise not_found("job", job_id)
    if found.status in RETRYABLE_STATUSES and not jobs.used_retry_key(found, key):
        admit_retry(session, services, tenant, found)
    outcome = jobs.retry(session, found.id, tenant, now, key=key, run_at=run_at)
    job = _retried(outcome, job_id)
    if not outcome.replayed:
        services.admission.admitted(job.queue, tenant)
        if job.status == QUEUED:  # a scheduled one is published when due
            services.dispatcher.dispatch(job.id, job.queue)
    return job, outcome.replayed


def _retried(outcome: jobs.RetryResult, job_id: str) -> Job:
    if outcome.job is None:
        raise not_found("job", job_id)
    if outcome.open_batch_id is not None:
        raise ApiError(409, "not_retryable", f"id: job {job_id} belongs to batch {outcome.open_batch_id}, "
                       "which has not ended; retry it once the batch has", "id")
    if not outcome.applied and not outcome.replayed and outcome.job.status in RETRYABLE_STATUSES:
        raise ApiError(409, "not_retryable", f"id: job {job_id} changed while it was being retried (another "
                       "request retried or cancelled it); send the retry again", "id")
    if not outcome.applied and not outcome.replayed:
        raise ApiError(409, "not_retryable", f"id: job {job_id} is {outcome.job.status}; only a failed, "
                       "cancelled or expired job can be retried", "id")
    return outcome.job
