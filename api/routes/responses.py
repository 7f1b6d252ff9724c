"""OpenAI's Responses API on Conveyor's jobs: POST /v1/responses, GET /v1/responses/{id} (`stream=true`
resumes its events), POST /v1/responses/{id}/cancel, DELETE /v1/responses/{id} and GET
/v1/responses/{id}/input_items.

Each response is a job (queue, tenant, fair share, deadlines and webhooks all apply), submitted exactly as
POST /v1/jobs submits one, its body judged by the chat rules (api/response_jobs.py). `background: true`
answers `queued` at once: the job is durable, so the response survives a restart and is served by any
replica; the client polls, streams or cancels it. Otherwise the call answers once the job ends (or streams
its events), and `store: false` deletes the job once answered.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from conveyor.api import openai_sync
from conveyor.api.auth import WaitingTenant
from conveyor.api.chat_jobs import model_of
from conveyor.api.deps import Services, ServicesDep
from conveyor.api.errors import ApiError
from conveyor.api.job_actions import cancel
from conveyor.api.openai_errors import OpenAIError, OpenAIRoute
from conveyor.api.openai_sync import FollowedJob
from conveyor.api.response_jobs import earlier_conversation, forget, job_body, with_response
from conveyor.api.response_streams import StreamedResponse, live, resumed
from conveyor.api.schemas.errors import openai_error_responses, sse_schema
from conveyor.api.schemas.jobs import JobCreate
from conveyor.api.submit import submit
from conveyor.core.clock import utcnow
from conveyor.core.protocol.chat_options import ChatOptions
from conveyor.core.protocol.responses_request import ResponseCreate
from conveyor.core.seams.token_stream import TokenStream
from conveyor.core.store import jobs
from conveyor.core.store.tables import Job
from conveyor.core.views.response_objects import input_item_list, job_id_of, response_id, response_object

router = APIRouter(prefix="/v1/responses", tags=["openai"], route_class=OpenAIRoute)
RESPONSE = {"description": "the `response` object, or its server-sent events with `stream: true`",
            "content": {"application/json": {"schema": {"type": "object"}},
                        "text/event-stream": {"schema": sse_schema("a Responses event as JSON")}}}
OBJECT = {"description": "the `response` object",
          "content": {"application/json": {"schema": {"type": "object"}}}}


@router.post("", response_model=None,
             responses={200: RESPONSE, **openai_error_responses(400, 401, 403, 404, 409, 413, 429, 504)})
async def create_response(
    body: ResponseCreate, request: Request, services: ServicesDep, tenant: WaitingTenant,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> Response:
    """A `response`: `queued` at once with `background: true`, else once its job has ended; server-sent
    events with `stream: true`. Sent again with the same Idempotency-Key and body, the response it created
    (its job is not submitted twice); with another body, a 409."""
    model = model_of(services, body.model, task="generate", tenant=tenant)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        history = await run_in_threadpool(earlier_conversation, services, tenant, body.previous_response_id)
    job = await run_in_threadpool(job_body, model, body, history)
    if body.background and not body.stream:
        created = await run_in_threadpool(_submit, services, tenant, job, body.stored(), idempotency_key)
        return JSONResponse(created, headers=_job_header(created["id"]))
    stream: TokenStream | None = getattr(request.app.state, "token_stream", None)
    followed = await openai_sync.start(services, stream, tenant, job, responses_request=body.stored(),
                                       idempotency_key=idempotency_key)
    headers = _job_header(response_id(followed.job_id))
    if body.stream:
        options = job.chat_options(model.tool_parser)
        shown = StreamedResponse(options, _stops(job), body.background, body.store)
        events = live(services, tenant, followed, shown, request.is_disconnected)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache"})
    return await _answered(services, tenant, followed, request, store=body.store, headers=headers)


@router.get("/{response_id}", response_model=None,
            responses={200: RESPONSE, **openai_error_responses(400, 401, 404)})
async def get_response(
    response_id: str, request: Request, services: ServicesDep, tenant: WaitingTenant,
    stream: Annotated[bool, Query(description="the response's events: live, or replayed once ended")] = False,
    starting_after: Annotated[int | None, Query(ge=-1, description="with stream: the events after this "
                                                "sequence number")] = None,
) -> Response:
    """The response as it is now; with `stream=true` (background responses only) its events."""
    if not stream:
        return JSONResponse(await run_in_threadpool(with_response, services, tenant, response_id,
                                                    response_object))
    token_stream: TokenStream | None = getattr(request.app.state, "token_stream", None)
    followed, status, shown = await _follow_again(services, tenant, response_id, token_stream,
                                                  starting_after)
    events = resumed(services, tenant, followed, shown, request.is_disconnected, status=status)
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@router.post("/{response_id}/cancel", response_model=None,
             responses={200: OBJECT, **openai_error_responses(400, 401, 404, 409)})
def cancel_response(response_id: str, services: ServicesDep, tenant: WaitingTenant) -> JSONResponse:
    """Cancels a background response that is queued or in progress; it ends `cancelled`."""
    def background(job: Job) -> bool:
        return bool((job.responses_request or {}).get("background"))

    if not with_response(services, tenant, response_id, background):
        raise OpenAIError(400, f"id: response {response_id} was not created with background true; only "
                          "background responses can be cancelled", param="id")
    job_id = job_id_of(response_id)
    assert job_id is not None, "with_response found the response"
    with services.session_factory() as session:  # the read's session is closed: one session at a time
        try:
            return JSONResponse(response_object(cancel(session, services, tenant, job_id)))
        except ApiError as exc:
            raise OpenAIError(exc.status, f"id: response {response_id} has already ended",
                              code=exc.code, param="id") from None


@router.delete("/{response_id}", response_model=None,
               responses={200: {"description": "{id, object: response, deleted: true}"},
                          **openai_error_responses(400, 401, 404, 409)})
def delete_response(response_id: str, services: ServicesDep, tenant: WaitingTenant) -> JSONResponse:
    """Deletes a response that has ended (or has not started), with its job; one in progress is a 409."""
    status = with_response(services, tenant, response_id, lambda job: job.status)
    with services.session_factory() as session:
        gone = jobs.delete_finished(session, job_id_of(response_id) or "", tenant).deleted
    if not gone:
        raise OpenAIError(409, f"id: response {response_id} is {status}; cancel it before deleting it",
                          code="not_deletable", param="id")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.get("/{response_id}/input_items", response_model=None,
            responses={200: {"description": "a list of the response's input items"},
                       **openai_error_responses(400, 401, 404)})
def list_input_items(
    response_id: str, services: ServicesDep, tenant: WaitingTenant,
    limit: Annotated[int, Query(ge=1, le=100)] = 20, order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> JSONResponse:
    """This turn's input items (not the earlier turns' of previous_response_id), newest first by default."""
    items = with_response(services, tenant, response_id, input_item_list)
    if order == "desc":
        items.reverse()
    ids = [item["id"] for item in items]
    start = ids.index(after) + 1 if after in ids else 0
    page = items[start: start + limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None,
                         "has_more": start + limit < len(items)})


def _submit(services: Services, tenant: str, job: JobCreate, stored: dict[str, Any],
            idempotency_key: str | None) -> dict[str, Any]:
    with services.session_factory() as session:
        row, _ = submit(session, services, tenant, job, idempotency_key, utcnow(), responses_request=stored)
        return response_object(row)


async def _answered(services: Services, tenant: str, followed: FollowedJob, request: Request, *, store: bool,
                    headers: dict[str, str]) -> Response:
    """The response once its job has ended; a job that failed is the chat route's error for it."""
    outcome = await openai_sync.wait_outcome(services, tenant, followed, request.is_disconnected)
    if outcome is None:
        return Response(status_code=499)  # nobody is listening; logged by the server only
    answer = await run_in_threadpool(with_response, services, tenant, response_id(followed.job_id),
                                     response_object)
    if not store:
        await run_in_threadpool(forget, services, tenant, followed.job_id)
    if outcome.status in ("failed", "expired"):
        raise openai_sync.outcome_error(outcome)
    return JSONResponse(answer, headers=headers)


async def _follow_again(services: Services, tenant: str, response_id: str, stream: TokenStream | None,
                        starting_after: int | None) -> tuple[FollowedJob, str, StreamedResponse]:
    """The token subscription of a response's job (taken before its status is read, so a job not started
    then is followed from its first token), its job's status then, and how its answer is read."""
    job_id = job_id_of(response_id) or response_id  # not a response's id: with_response answers 404
    subscription = None
    if stream is not None:
        try:
            subscription = await stream.subscribe(job_id)
        except Exception:  # its events then come from the store at the end
            subscription = None

    def state(job: Job) -> tuple[str, StreamedResponse]:
        if not (job.responses_request or {}).get("background"):
            raise OpenAIError(400, f"stream: response {response_id} was not created with background true; "
                              "only background responses can be streamed again", param="stream")
        stops = job.params.get("stop") or []
        return job.status, StreamedResponse(ChatOptions.from_json(job.chat), stops, True,
                                            starting_after=starting_after)

    try:
        status, shown = await run_in_threadpool(with_response, services, tenant, response_id, state)
    except BaseException:
        if subscription is not None:
            await subscription.close()
        raise
    return FollowedJob(job_id, subscription), status, shown


def _stops(job: JobCreate) -> list[str]:
    return [job.stop] if isinstance(job.stop, str) else list(job.stop or [])


def _job_header(response: str) -> dict[str, str]:
    return {"X-Conveyor-Job-Id": job_id_of(response) or response}
