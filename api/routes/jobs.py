"""/v1/jobs: submit, read (at once, by long poll, or as server-sent events), list, cancel, retry, delete."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Body, Header, Query, Request, Response
from fastapi.responses import StreamingResponse

from conveyor.api import cursor, job_actions, job_waits
from conveyor.api.auth import CurrentTenant, WaitingTenant
from conveyor.api.deps import Services, ServicesDep, SessionDep
from conveyor.api.direct_route import direct_route
from conveyor.api.errors import ApiError, can_be_stored_id, lookup_id, not_found, raise_problem
from conveyor.api.job_waits import EVENTS_MAX_S, KEEPALIVE_S, MAX_WAIT_S
from conveyor.api.model_responses import model_response
from conveyor.api.schemas.deleted import Deleted
from conveyor.api.schemas.errors import error_responses, sse_schema
from conveyor.api.schemas.jobs import JobList, JobSubmission
from conveyor.api.schemas.scheduling import RetryRequest
from conveyor.api.submit import submit
from conveyor.core.clock import utcnow
from conveyor.core.lifecycle import TERMINAL_STATUSES
from conveyor.core.protocol.job_kinds import GENERATION
from conveyor.core.protocol.request_limits import idempotency_key_problem
from conveyor.core.seams.token_stream import Subscription, TokenStream
from conveyor.core.settings import UnknownModelError
from conveyor.core.store import jobs
from conveyor.core.views.public import JobPublic, JobStatus

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
REPLAYED = {200: {"model": JobPublic, "description": "an Idempotency-Key replay: the job it created"}}
EVENTS = {200: {"description": "server-sent events: `event: job`, `data:` the job as `GET /v1/jobs/{id}` "
                               "returns it",
                "content": {"text/event-stream": {"schema": sse_schema("the job, as JSON")}}}}
EVENTS_DESCRIPTION = (
    "Server-sent events: `event: job` with the job at once, then each time its status changes; while it "
    "runs, `event: delta` with each piece of generated text as the worker produces it (`{text, index, "
    "attempt, tokens}`: the token stream the OpenAI routes use; a requeued job streams again from its first "
    "token, under its new attempt), then the final job. The stream ends "
    f"after the final status, or after {EVENTS_MAX_S / 60:g} minutes with the current state (reconnect to "
    f"follow on). A comment line at least every {KEEPALIVE_S:g} s keeps it open through proxies."
)
Wait = Annotated[float | None, Query(
    gt=0, le=MAX_WAIT_S, allow_inf_nan=False,
    description=f"long poll: answer as soon as the job is final, or after this many seconds (at most "
                f"{MAX_WAIT_S:g}) with its current state",
)]


class EventStream(StreamingResponse):
    media_type = "text/event-stream"


def _json_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """error_responses(...) for a route whose own media type is not JSON: its errors still answer JSON (a
    `model` would be declared under the route's media type)."""
    ref = {"$ref": "#/components/schemas/ErrorBody"}
    return {status: {"description": declared["description"], "content": {"application/json": {"schema": ref}}}
            for status, declared in error_responses(*statuses).items()}


@direct_route(router, "", methods=["POST"], status_code=202, response_model=JobPublic,
              responses={**REPLAYED, **error_responses(401, 403, 404, 409, 413, 422, 429)})
def create_job(
    body: JobSubmission,
    session: SessionDep,
    services: ServicesDep,
    tenant: CurrentTenant,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> Response:
    """Queues a job (202): a generation job (`prompt` or `messages`), or with `kind: "embedding"` a vector per
    `input`. Replaying an Idempotency-Key with the same body returns the original job (200)."""
    job, created = submit(session, services, tenant, body, idempotency_key, utcnow())
    return model_response(JobPublic.from_row(job), 202 if created else 200)


@direct_route(router, "/{job_id}", methods=["GET"], response_model=JobPublic,
              responses=error_responses(401, 404, 422))
async def get_job(
    job_id: str, request: Request, services: ServicesDep, tenant: WaitingTenant, wait: Wait = None
) -> Response:
    """The job. With `wait=S`, a long poll: the answer comes as soon as the job is final (succeeded,
    failed, cancelled or expired), or after S seconds with the job as it is then; always 200."""
    if wait is None:
        job = await job_waits.read_or_404(services, job_id, tenant)
    else:
        job = await job_waits.until_final(services, job_id, tenant, wait, request.is_disconnected)
    return model_response(job)


@router.get("/{job_id}/events", response_class=EventStream, description=EVENTS_DESCRIPTION,
            responses={**EVENTS, **_json_errors(401, 404)})
async def job_events(job_id: str, request: Request, services: ServicesDep, tenant: WaitingTenant,
                     ) -> EventStream:
    job = await job_waits.read_or_404(services, job_id, tenant)  # an unknown job: a 404, not an empty stream
    deltas = None
    stream: TokenStream | None = request.app.state.token_stream
    if stream is not None and job.status not in TERMINAL_STATUSES and job.kind == GENERATION:
        deltas = await _subscribed(stream, job.id)
    return EventStream(_closing(job_waits.events(services, job.id, tenant, deltas), deltas),
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _subscribed(stream: TokenStream, job_id: str) -> Subscription | None:
    try:
        return await stream.subscribe(job_id)
    except Exception as exc:  # e.g. Redis unreachable: status events still come from the store
        log.warning("token stream: subscribing to %s failed (%s); its events carry no deltas", job_id, exc)
        return None


async def _closing(events: AsyncIterator[str], deltas: Subscription | None) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield event
    finally:
        if deltas is not None:
            with anyio.CancelScope(shield=True):
                await deltas.close()


@router.get("", response_model=JobList, responses=error_responses(401, 422))
def list_jobs(
    session: SessionDep,
    services: ServicesDep,
    tenant: CurrentTenant,
    status: JobStatus | None = None,
    queue: str | None = None,
    model: Annotated[str | None, Query(description="only this served model's jobs")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    cursor_: Annotated[str | None, Query(alias="cursor")] = None,
) -> JobList:
    """Newest first. Pass `next_cursor` back as `cursor` for the next page."""
    lanes = _listed_lanes(services, model, queue)
    try:
        before = cursor.decode(cursor_) if cursor_ else None
    except ValueError as exc:
        raise ApiError(422, "invalid_request", str(exc), "cursor") from exc
    if before is not None and not can_be_stored_id(before[1]):  # forged: no job id looks like that
        raise ApiError(422, "invalid_request", "cursor: not a cursor returned by this API", "cursor")
    rows = jobs.page(session, tenant, limit=limit + 1, status=status, lanes=lanes, before=before)
    page, more = rows[:limit], len(rows) > limit
    next_cursor = cursor.encode(page[-1]) if more else None
    return JobList(data=[JobPublic.from_row(j) for j in page], next_cursor=next_cursor)


def _listed_lanes(services: Services, model_id: str | None, queue: str | None) -> list[str] | None:
    """The lanes (core/lanes.py) a listing filtered by model and queue covers; None: no filter."""
    if model_id is None and queue is None:
        return None
    try:
        models = list(services.models) if model_id is None else [services.models.get(model_id)]
    except UnknownModelError as exc:
        raise ApiError(422, "unknown_model", str(exc), "model") from None
    lanes = [model.lane(name) for model in models for name in model.settings.queues if queue in (None, name)]
    if not lanes:
        raise ApiError(422, "unknown_queue", f"queue: unknown queue {queue!r}", "queue")
    return lanes


@router.post("/{job_id}/cancel", response_model=JobPublic, responses=error_responses(401, 404, 409))
def cancel_job(job_id: str, session: SessionDep, services: ServicesDep, tenant: CurrentTenant) -> JobPublic:
    """Cancels a scheduled, queued or running job (a running one is aborted in the engine within a step)."""
    return JobPublic.from_row(job_actions.cancel(session, services, tenant, lookup_id("job", job_id)))


@router.post("/{job_id}/retry", response_model=JobPublic,
             responses={**REPLAYED, **error_responses(401, 404, 409, 422, 429)}, status_code=202)
def retry_job(
    job_id: str,
    session: SessionDep,
    services: ServicesDep,
    tenant: CurrentTenant,
    body: Annotated[RetryRequest | None, Body()] = None,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> Response:
    """Runs a failed, cancelled or expired job again under the same id (202): queued at once, or scheduled
    with `run_at` / `delay_s`; its outcome so far is kept in `history`, its next run counts in `attempts`. A
    queued, scheduled or running job, or a succeeded one, is refused (409), as is one of a batch that has not
    ended. It is admitted as a submission is (429 when its queue is full or its tenant at its limit). With an
    Idempotency-Key, a second call with the key answers the job (200) without retrying it."""
    now = utcnow()
    if idempotency_key is not None:
        raise_problem(idempotency_key_problem(idempotency_key))
    run_at = (body or RetryRequest()).due_at(now)
    job, replayed = job_actions.retry(session, services, tenant, lookup_id("job", job_id), now,
                                      key=idempotency_key, run_at=run_at)
    return model_response(JobPublic.from_row(job), 200 if replayed else 202)


@router.delete("/{job_id}", response_model=Deleted, responses=error_responses(401, 404, 409))
def delete_job(job_id: str, session: SessionDep, tenant: CurrentTenant) -> Deleted:
    """Deletes a finished job (succeeded, failed, cancelled or expired) or a scheduled one: its prompt,
    result, logprobs and webhook deliveries. A queued or running job is refused (409): cancel it first, then
    delete it."""
    outcome = jobs.delete_finished(session, lookup_id("job", job_id), tenant)
    if outcome.status is None:
        raise not_found("job", job_id)
    if outcome.open_batch_id is not None:
        message = (f"id: job {job_id} belongs to batch {outcome.open_batch_id}, which has not ended; delete "
                   "the batch once it has")
        raise ApiError(409, "not_deletable", message, "id")
    if not outcome.deleted:
        raise ApiError(409, "not_deletable", f"id: job {job_id} is {outcome.status}; cancel it first "
                       f"(POST /v1/jobs/{job_id}/cancel), then delete it", "id")
    return Deleted(id=job_id, object="job")
