"""OpenAI-compatible synchronous routes: /v1/chat/completions and /v1/completions (with `stream`), /v1/models.

Each completion is a job on the `interactive` queue, submitted exactly like POST /v1/jobs (same checks,
limits and 429s, same tenant) and answered when it ends; `stream: true` answers server-sent events while it
runs. A completion's several prompts are that one job (core/protocol/completion_prompts.py says why), its
choices numbered prompt * n + choice. The completion id is "chatcmpl-<job id>" / "cmpl-<job id>" (also in the
X-Conveyor-Job-Id header), so the job stays visible under /v1/jobs.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from conveyor.api import openai_sync
from conveyor.api.auth import WaitingTenant
from conveyor.api.chat_jobs import (
    default_chat_max_tokens,
    generation_result,
    job_create,
    model_of,
    served_of,
)
from conveyor.api.deps import Services, ServicesDep
from conveyor.api.openai_errors import OpenAIError, OpenAIRoute, from_refusal
from conveyor.api.openai_sync import ClientGoneError, FollowedJob, JobOutcome
from conveyor.api.schemas.errors import openai_error_responses, sse_schema
from conveyor.api.schemas.jobs import JobCreate
from conveyor.api.schemas.openai import (
    ChatCompletionCreate,
    CompletionCreate,
    ModelCard,
    ModelList,
    OpenAIRequest,
)
from conveyor.api.served_models import ServedModel
from conveyor.core.clock import utcnow
from conveyor.core.protocol.chat_options import ToolParser
from conveyor.core.protocol.openai_request import Served, check_request
from conveyor.core.protocol.refusal import Refusal
from conveyor.core.seams.token_stream import TokenStream
from conveyor.core.store import workers
from conveyor.core.views.openai_objects import (
    ChunkHeader,
    chunk,
    delta_chunk,
    finish_reason,
    running_usage,
    usage_chunk,
)
from conveyor.core.views.openai_objects import chat_completion as chat_body
from conveyor.core.views.openai_objects import text_completion as text_body
from conveyor.core.views.tool_calls import choice_seed
from conveyor.core.views.tool_stream import (
    ContentStream,
    StreamDivergedError,
    ToolCallStream,
    answer_stream,
)

router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute)
COMPLETION_RESPONSES = {
    200: {"description": "the completion object, or server-sent events with `stream: true`",
          "content": {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"schema": sse_schema("a chunk as JSON, or [DONE]")}}},
    **openai_error_responses(400, 401, 403, 404, 409, 413, 429, 504),
}
DONE = "data: [DONE]\n\n"
log = logging.getLogger(__name__)


@router.post("/chat/completions", response_model=None, responses=COMPLETION_RESPONSES)
async def create_chat_completion(
    body: ChatCompletionCreate, request: Request, services: ServicesDep, tenant: WaitingTenant
) -> Response:
    """A `chat.completion`, or `chat.completion.chunk` server-sent events with `stream: true`."""
    model = model_of(services, body.model, task="generate", tenant=tenant)
    served = served_of(model)
    _check_request(served, body)
    try:
        messages = body.chat_messages(served.roles)
    except Refusal as refusal:
        raise from_refusal(refusal) from None
    max_tokens = body.requested_max_tokens()
    if max_tokens is None:
        options = body.chat_options(model.tool_parser)
        max_tokens = await run_in_threadpool(default_chat_max_tokens, model, messages, options)
    job = job_create(model, body, max_tokens, messages=messages)
    return await _complete(request, services, model, tenant, body, job, chat=True)


@router.post("/completions", response_model=None, responses=COMPLETION_RESPONSES)
async def create_completion(
    body: CompletionCreate, request: Request, services: ServicesDep, tenant: WaitingTenant
) -> Response:
    """A `text_completion`, or `text_completion` server-sent events with `stream: true`."""
    model = model_of(services, body.model, task="generate", tenant=tenant)
    _check_request(served_of(model), body)
    job = job_create(model, body, body.max_tokens, prompt=body.prompt)
    return await _complete(request, services, model, tenant, body, job, chat=False)


@router.get("/models", response_model=ModelList, responses=openai_error_responses(401))
def list_models(services: ServicesDep, tenant: WaitingTenant) -> ModelList:
    """Every served model and the LoRA adapters the tenant may use (each with its base as `parent`), with
    its context length and the live workers serving it now."""
    serving = _serving(services)
    return ModelList(data=[_model_card(model, serving) for model in services.models.visible_to(tenant)])


@router.get("/models/{model_id:path}", response_model=ModelCard, responses=openai_error_responses(401, 404))
def get_model(model_id: str, services: ServicesDep, tenant: WaitingTenant) -> ModelCard:
    model = model_of(services, model_id, param=None, tenant=tenant)
    return _model_card(model, _serving(services))


def _serving(services: Services) -> dict[str, int]:
    with services.session_factory() as session:
        return workers.live_workers_per_model(session, now=utcnow(),
                                              dead_after_s=services.settings.worker_dead_after_s)


def _model_card(model: ServedModel, serving: dict[str, int]) -> ModelCard:
    return ModelCard(id=model.id, created=model.created(), max_model_len=model.max_model_len(),
                     workers=serving.get(model.parent or model.id, 0), task=model.task.task,
                     embedding_size=model.task.embedding_size if model.task.embeds else None,
                     parent=model.parent, quantization=model.quantization,
                     speculative=model.settings.speculation_method())


def _check_request(served: Served, body: OpenAIRequest) -> None:
    """The rules batch lines follow too (core/protocol/openai_request.py): 404 for a model this server does
    not serve, 400 for a parameter Conveyor cannot honour."""
    try:
        check_request(body, served)
    except Refusal as refusal:
        raise from_refusal(refusal) from None


async def _complete(
    request: Request, services: Services, model: ServedModel, tenant: str, body: OpenAIRequest,
    job_body: JobCreate, *, chat: bool,
) -> Response:
    stream: TokenStream | None = getattr(request.app.state, "token_stream", None)
    job = await openai_sync.start(services, stream, tenant, job_body)
    prefix = "chatcmpl-" if chat else "cmpl-"
    header = ChunkHeader(prefix + job.job_id, model.id, int(time.time()), chat, body.service_tier)
    headers = {"X-Conveyor-Job-Id": job.job_id}
    if body.stream:
        usage = StreamUsage(body.include_usage(), body.continuous_usage())
        echoed = await run_in_threadpool(_echoed, model, job_body) if body.prompt_view().echo else None
        events = _events(request, services, tenant, job, header, job_body, model.tool_parser, usage, echoed)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache"})
    outcome = await openai_sync.wait_outcome(services, tenant, job, request.is_disconnected)
    if outcome is None:
        return Response(status_code=499)  # nobody is listening; logged by the server only
    result = generation_result(outcome, header.model, header.created, service_tier=header.service_tier,
                               shown=body.prompt_view())
    completion = (chat_body if chat else text_body)(result, header.completion_id)
    return JSONResponse(completion, headers=headers)


async def _events(
    request: Request, services: Services, tenant: str, job: FollowedJob, header: ChunkHeader,
    job_body: JobCreate, tool_parser: ToolParser, usage: StreamUsage, echoed: list[str] | None = None,
) -> AsyncIterator[str]:
    """Server-sent events: (each choice's echoed prompt,) deltas as the job generates, each under its choice's
    index (prompt * n + choice), then the finish (and usage) chunks and [DONE]."""
    stops = [job_body.stop] if isinstance(job_body.stop, str) else job_body.stop or []
    # The engine cuts a matched stop string off the text: hold back what could be the start of one.
    hold = max((len(s) for s in stops), default=1) - 1
    options = job_body.chat_options(tool_parser)
    choices = job_body.choice_count()
    answers = [answer_stream(options, choice_seed(job.job_id, index)) for index in range(choices)]
    outcome = None
    so_far = usage.so_far(job.prompt_tokens, 0)
    try:
        for index in range(choices):
            if header.chat:
                yield _data(chunk(header, "", role=True, usage_so_far=so_far, index=index))
            if echoed:
                yield _data(chunk(header, echoed[index // job_body.n], usage_so_far=so_far, index=index))
        async for item in openai_sync.follow(services, job, request.is_disconnected):
            if isinstance(item, JobOutcome):
                outcome = item
                continue
            so_far = usage.so_far(job.prompt_tokens, item.tokens)
            answer = answers[item.index] if item.index < len(answers) else None
            sendable = item.text[: max(0, len(item.text) - hold)]
            for delta in answer.update(sendable) if answer is not None else []:
                yield _data(_delta_chunk(header, delta, None, so_far, item.index))
    except ClientGoneError:
        return
    except Exception:  # the response has started: end the stream properly (the job is cancelled below)
        log.exception("streaming job %s failed", job.job_id)
        yield _data(OpenAIError(500, "internal server error", code="internal_error").body())
        yield DONE
        return
    finally:
        await openai_sync.finish(services, job, tenant, cancel=outcome is None)
    for event in _closing_events(outcome, header, answers, usage):
        yield event


@dataclass(frozen=True)
class StreamUsage:
    """What a stream says of usage: a last chunk with it (include_usage), and it in every chunk as well
    (vLLM's continuous_usage_stats)."""

    at_end: bool
    in_every_chunk: bool

    def so_far(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any] | None:
        return running_usage(prompt_tokens, completion_tokens) if self.in_every_chunk else None


def _closing_events(outcome: JobOutcome | None, header: ChunkHeader,
                    answers: list[ContentStream | ToolCallStream], stream_usage: StreamUsage) -> list[str]:
    """Per choice, what its stream still lacks and its finish chunk; then the usage chunk and [DONE]."""
    assert outcome is not None, "follow() ends with the outcome"
    try:
        result = generation_result(outcome, header.model, header.created, service_tier=header.service_tier)
        closed = [(choice, *answers[choice.index].close(choice.text)) for choice in result.each_choice()]
    except StreamDivergedError as exc:
        return [_data(OpenAIError(500, str(exc), code="stream_diverged").body()), DONE]
    except OpenAIError as exc:
        return [_data(exc.body()), DONE]
    so_far = stream_usage.so_far(result.prompt_tokens, result.completion_tokens)
    events = []
    for choice, deltas, called_tools in closed:
        events += [_data(_delta_chunk(header, delta, None, so_far, choice.index)) for delta in deltas]
        finish = finish_reason(choice.finish_reason, called_tools=called_tools)
        events.append(_data(chunk(header, None if header.chat else "", finish, usage_so_far=so_far,
                                  index=choice.index)))
    if stream_usage.at_end:
        events.append(_data(usage_chunk(header, result)))
    return [*events, DONE]


def _delta_chunk(header: ChunkHeader, delta: dict[str, Any], finish: str | None,
                 so_far: dict[str, Any] | None, index: int = 0) -> dict[str, Any]:
    """A chat delta as a chat chunk; a completion's only delta is text."""
    if header.chat:
        return delta_chunk(header, delta, finish, usage_so_far=so_far, index=index)
    return chunk(header, delta["content"], finish, usage_so_far=so_far, index=index)


def _echoed(model: ServedModel, job_body: JobCreate) -> list[str]:
    """Each prompt as a stream's echo shows it: a text as sent, token ids decoded (as the worker stores
    them for the answer that is not streamed)."""
    prompts = job_body.prompts()
    assert prompts is not None, "echo is a completion's"
    return [item if isinstance(item, str) else model.tokenizer.decode(item) for item in prompts.items]


def _data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
