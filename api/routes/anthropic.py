"""Anthropic's Messages API: POST /v1/messages (with `stream`) and POST /v1/messages/count_tokens.

A message is a job on the `interactive` queue, submitted as a chat completion submits one: the body is
translated into the OpenAI chat request (core/protocol/anthropic_request.py) and judged by the same rules,
then the same job is built and submitted (same limits, 429s, tenant, fair share, deadlines, webhooks) and
answered when it ends; `stream: true` answers Anthropic's server-sent events while it runs. The message id
is "msg_<job id>" (also in the X-Conveyor-Job-Id header), so the job stays visible under /v1/jobs. Errors
come in Anthropic's shape, naming the request's own fields (api/anthropic_errors.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from conveyor.api import openai_sync
from conveyor.api.anthropic_errors import AnthropicError, AnthropicRoute, anthropic_errors, from_openai_error
from conveyor.api.auth import AnthropicTenant
from conveyor.api.chat_jobs import generation_result, job_create, model_of, served_of
from conveyor.api.deps import Services, ServicesDep
from conveyor.api.openai_errors import OpenAIError
from conveyor.api.openai_sync import ClientGoneError, FollowedJob, JobOutcome
from conveyor.api.schemas.errors import anthropic_error_responses, sse_schema
from conveyor.api.schemas.messages import MessageCountTokens, MessageCreate, MessageTokensCount
from conveyor.api.served_models import ServedModel
from conveyor.core.protocol.chat_options import ChatOptions
from conveyor.core.views.anthropic_objects import ending, error_body, error_type, message_id, message_object
from conveyor.core.views.anthropic_stream import (
    MESSAGE_STOP,
    PING,
    BlockStream,
    message_delta,
    message_start,
    sendable,
)
from conveyor.core.views.tool_calls import choice_seed
from conveyor.core.views.tool_stream import ContentStream, StreamDivergedError, ToolCallStream, answer_stream

router = APIRouter(prefix="/v1", tags=["anthropic"], route_class=AnthropicRoute)
MESSAGE_RESPONSES = {
    200: {"description": "the message object, or Anthropic's server-sent events with `stream: true`",
          "content": {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"schema": sse_schema("the event as JSON")}}},
    **anthropic_error_responses(400, 401, 403, 404, 409, 413, 429, 504),
}
log = logging.getLogger(__name__)


@router.post("/messages", response_model=None, responses=MESSAGE_RESPONSES)
async def create_message(
    body: MessageCreate, request: Request, services: ServicesDep, tenant: AnthropicTenant
) -> Response:
    """A `message`, or its server-sent events with `stream: true`."""
    token_stream = getattr(request.app.state, "token_stream", None)  # None: the text comes from the store
    with anthropic_errors(body.anthropic_field):
        model = model_of(services, body.model, task="generate", tenant=tenant)
        judged = body.judged(served_of(model))
        job_body = job_create(model, judged.request, body.max_tokens, messages=judged.messages)
        job = await openai_sync.start(services, token_stream, tenant, job_body)
    headers = {"X-Conveyor-Job-Id": job.job_id}
    options = job_body.chat_options(model.tool_parser)
    answer = Answer(model.id, int(time.time()), options, body.stop_sequences or [])
    if body.stream:
        events = _events(request, services, tenant, job, answer)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache"})
    outcome = await openai_sync.wait_outcome(services, tenant, job, request.is_disconnected)
    if outcome is None:
        return Response(status_code=499)  # nobody is listening; logged by the server only
    with anthropic_errors(body.anthropic_field):
        result = generation_result(outcome, answer.model, answer.created)
    message = message_object(result, message_id(job.job_id), answer.stop_sequences)
    return JSONResponse(message, headers=headers)


@router.post("/messages/count_tokens", response_model=MessageTokensCount,
             responses=anthropic_error_responses(400, 401, 404))
async def count_tokens(body: MessageCountTokens, services: ServicesDep, tenant: AnthropicTenant,
                       ) -> MessageTokensCount:
    """The prompt's tokens as a message's job counts them (the model's tokenizer and chat template, with the
    tools): its usage's input_tokens and cache_read_input_tokens add up to this."""
    with anthropic_errors(body.anthropic_field):
        model = model_of(services, body.model, task="generate", tenant=tenant)
        judged = body.judged(served_of(model))
        options = judged.request.chat_options(model.tool_parser)
        counted = await run_in_threadpool(_count, model, judged.messages, options)
    return MessageTokensCount(input_tokens=counted)


def _count(model: ServedModel, messages: list[dict[str, Any]], options: ChatOptions) -> int:
    try:
        return model.tokenizer.count_messages(messages, options)
    except ValueError as exc:  # no chat template, or one that refuses the messages
        raise AnthropicError(400, str(exc)) from None


@dataclass(frozen=True)
class Answer:
    """How a message's job is answered: its model, when, how its text is read, the stop sequences it may
    end with (kept at the end of its text: core/views/anthropic_objects.py `ending`)."""

    model: str
    created: int
    options: ChatOptions
    stop_sequences: Sequence[str]


async def _events(request: Request, services: Services, tenant: str, job: FollowedJob, answer: Answer,
                  ) -> AsyncIterator[str]:
    """Anthropic's events (core/views/anthropic_stream.py) as the job generates; an error once the stream
    has started is an `error` event."""
    stream = answer_stream(answer.options, choice_seed(job.job_id, 0))
    blocks = BlockStream()
    yield _event(message_start(message_id(job.job_id), answer.model, job.prompt_tokens))
    if isinstance(stream, ContentStream):
        for event in blocks.open_text():
            yield _event(event)
    yield _event(PING)
    outcome = None
    try:
        async for item in openai_sync.follow(services, job, request.is_disconnected):
            if isinstance(item, JobOutcome):
                outcome = item
                continue
            text = sendable(item.text, answer.stop_sequences)
            for delta in stream.update(text) if item.index == 0 else []:
                for event in blocks.events(delta):
                    yield _event(event)
    except ClientGoneError:
        return
    except Exception:  # the response has started: end the stream properly (the job is cancelled below)
        log.exception("streaming job %s failed", job.job_id)
        yield _event(error_body("api_error", "internal server error"))
        return
    finally:
        await openai_sync.finish(services, job, tenant, cancel=outcome is None)
    for event in _closing_events(outcome, answer, stream, blocks):
        yield _event(event)


def _closing_events(outcome: JobOutcome | None, answer: Answer, stream: ContentStream | ToolCallStream,
                    blocks: BlockStream) -> list[dict[str, Any]]:
    """What the stream still lacks, the last block's stop, message_delta and message_stop; or the error."""
    assert outcome is not None, "follow() ends with the outcome"
    try:
        result = generation_result(outcome, answer.model, answer.created)
        ended = ending(result.text, result.finish_reason, answer.stop_sequences)
        deltas, called_tools = stream.close(ended.text)
    except StreamDivergedError as exc:
        return [error_body("api_error", str(exc))]
    except OpenAIError as exc:
        error = from_openai_error(exc)
        return [error_body(error_type(error.status), error.message)]
    events = [event for delta in deltas for event in blocks.events(delta)]
    return [*events, *blocks.close(), message_delta(result, ended, called_tools), MESSAGE_STOP]


def _event(payload: dict[str, Any]) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"
