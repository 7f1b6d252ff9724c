"""/v1/jobs: submit, read, list, cancel."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Response
from sqlalchemy.orm import Session

from api import cursor
from api.auth import CurrentTenant
from api.deps import ServicesDep, SessionDep
from api.errors import ApiError, can_be_stored_id, lookup_id, not_found
from api.schemas.errors import error_responses
from api.schemas.jobs import JobCreate, JobList
from api.submit import submit
from core.clock import utcnow
from core.lifecycle import CANCELLED
from core.store import jobs
from core.store.tables import Job
from core.views import JobPublic, JobStatus

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
REPLAYED = {200: {"model": JobPublic, "description": "an Idempotency-Key replay: the job it created"}}


@router.post("", status_code=202, response_model=JobPublic,
             responses={**REPLAYED, **error_responses(401, 409, 413, 422, 429)})
def create_job(
    body: JobCreate,
    response: Response,
    session: SessionDep,
    services: ServicesDep,
    tenant: CurrentTenant,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> JobPublic:
    """Queues a job (202). Replaying an Idempotency-Key with the same body returns the original job (200)."""
    job, created = submit(session, services, tenant, body, idempotency_key, utcnow())
    if not created:
        response.status_code = 200
    return JobPublic.from_row(job)


@router.get("/{job_id}", response_model=JobPublic, responses=error_responses(401, 404))
def get_job(job_id: str, session: SessionDep, tenant: CurrentTenant) -> JobPublic:
    return JobPublic.from_row(_job_or_404(session, job_id, tenant))


@router.get("", response_model=JobList, responses=error_responses(401, 422))
def list_jobs(
    session: SessionDep,
    services: ServicesDep,
    tenant: CurrentTenant,
    status: JobStatus | None = None,
    queue: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    cursor_: Annotated[str | None, Query(alias="cursor")] = None,
) -> JobList:
    """Newest first. Pass `next_cursor` back as `cursor` for the next page."""
    if queue is not None and queue not in services.settings.queues:
        raise ApiError(422, "unknown_queue", f"queue: unknown queue {queue!r}", "queue")
    try:
        before = cursor.decode(cursor_) if cursor_ else None
    except ValueError as exc:
        raise ApiError(422, "invalid_request", str(exc), "cursor") from exc
    if before is not None and not can_be_stored_id(before[1]):  # forged: no job id looks like that
        raise ApiError(422, "invalid_request", "cursor: not a cursor returned by this API", "cursor")
    rows = jobs.page(session, tenant, limit=limit + 1, status=status, queue=queue, before=before)
    page, more = rows[:limit], len(rows) > limit
    next_cursor = cursor.encode(page[-1]) if more else None
    return JobList(data=[JobPublic.from_row(j) for j in page], next_cursor=next_cursor)


@router.post("/{job_id}/cancel", response_model=JobPublic, responses=error_responses(401, 404, 409))
def cancel_job(job_id: str, session: SessionDep, tenant: CurrentTenant) -> JobPublic:
    """Cancels a queued or running job (a running one is aborted in the engine within a step)."""
    job = jobs.cancel(session, lookup_id("job", job_id), tenant, utcnow())
    if job is None:
        raise not_found("job", job_id)
    if job.status != CANCELLED:
        raise ApiError(409, "not_cancellable", f"id: job {job_id} already {job.status}", "id")
    return JobPublic.from_row(job)


def _job_or_404(session: Session, job_id: str, tenant: str) -> Job:
    job = jobs.get(session, lookup_id("job", job_id), tenant)
    if job is None:
        raise not_found("job", job_id)
    return job
