"""Synchronous answers over the job queue: submit a job like POST /v1/jobs, then follow it to its end.

The API subscribes to the job's token stream before the job is published (so no delta is missed), then
waits without blocking the event loop: on stream events, and on the store (the source of truth), which it
reads when the worker signals the end and every STORE_POLL_S otherwise (often when no stream is wired).
A client that goes away gets its job cancelled (the worker aborts it in the engine and frees its KV).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

import anyio
from starlette.concurrency import run_in_threadpool

from conveyor.api.deps import Services
from conveyor.api.openai_errors import OpenAIError
from conveyor.api.schemas.jobs import AnyJobCreate
from conveyor.api.submit import submit
from conveyor.core.clock import utcnow
from conveyor.core.lifecycle import TERMINAL_STATUSES
from conveyor.core.seams.dispatch import Dispatcher
from conveyor.core.seams.token_stream import Subscription, TokenEvent, TokenStream
from conveyor.core.store import jobs
from conveyor.core.store.tables import Job

log = logging.getLogger(__name__)

EVENT_WAIT_S = 0.25  # how often a waiting request checks for a client disconnect
STORE_POLL_S = 1.0  # store reads between stream events (a lost end marker costs at most this)
STORE_POLL_NO_STREAM_S = 0.25
SUBSCRIBE_TIMEOUT_S = 10.0
NO_RETRY = {"x-should-retry": "false"}  # the openai SDK retries a 5xx unless told not to


class ClientGoneError(Exception):
    """The HTTP client disconnected while its job was queued or running."""


class Disconnected(Protocol):
    async def __call__(self) -> bool: ...


@dataclass(frozen=True)
class JobOutcome:
    """A finished job as the store has it (read in a worker thread, detached from any session)."""

    job_id: str
    status: str
    text: str | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    error_code: str | None
    error_message: str | None
    logprobs: list[dict[str, Any]] | None = None  # as the job stores them
    cached_tokens: int = 0  # prompt tokens from the engine's prefix cache
    chat: dict[str, Any] | None = None  # how its answer is read (core/protocol/chat_options.py)
    choices: list[dict[str, Any]] | None = None  # every choice of a job with n > 1 or inputs prompts
    prompt: str | None = None  # a completion's one text prompt (echo shows it)
    prompt_logprobs: list[dict[str, Any]] | None = None  # as the job stores them
    embeddings: list[str] | None = None  # an embedding job's vectors (core/views/embedding_vectors.py)
    draft_tokens: int = 0  # tokens speculative decoding drafted for it
    accepted_draft_tokens: int = 0  # of those, the ones the model accepted

    @classmethod
    def of(cls, job: Job) -> JobOutcome:
        return cls(job.id, job.status, job.result_text, job.finish_reason, job.prompt_tokens or 0,
                   job.completion_tokens or 0, job.error_code, job.error_message, job.logprobs,
                   job.cached_tokens or 0, job.chat, job.choices, job.prompt, job.prompt_logprobs,
                   job.embeddings, job.draft_tokens or 0, job.accepted_draft_tokens or 0)


class _SubscribeThenDispatch:
    """Wraps the app's dispatcher: subscribes to the job's tokens (on the app's loop) before dispatching."""

    def __init__(self, inner: Dispatcher, stream: TokenStream, loop: asyncio.AbstractEventLoop) -> None:
        self._inner, self._stream, self._loop = inner, stream, loop
        self.subscription: Subscription | None = None

    def dispatch(self, job_id: str, queue: str) -> None:
        try:
            future = asyncio.run_coroutine_threadsafe(self._stream.subscribe(job_id), self._loop)
            self.subscription = future.result(SUBSCRIBE_TIMEOUT_S)
        except Exception as exc:  # text then arrives from the store at the end
            log.warning("token stream: subscribing to %s failed (%s); polling the store", job_id, exc)
        self._inner.dispatch(job_id, queue)


@dataclass
class FollowedJob:
    job_id: str
    subscription: Subscription | None
    prompt_tokens: int = 0  # as counted at submit: what the job's usage will say


@dataclass(frozen=True)
class Generated:
    """A running attempt's text so far of one choice, and how many tokens all its choices are so far (0 when
    the worker does not say)."""

    text: str
    tokens: int
    index: int = 0


async def start(
    services: Services, stream: TokenStream | None, tenant: str, body: AnyJobCreate, *,
    responses_request: dict[str, Any] | None = None, idempotency_key: str | None = None,
) -> FollowedJob:
    """Submits (same checks, limits and 429s as POST /v1/jobs) with the token subscription in place
    (`responses_request`: kept with a job submitted through POST /v1/responses; an `idempotency_key`
    replay follows the job it created, from the store)."""
    publisher = None
    if stream is not None:
        publisher = _SubscribeThenDispatch(services.dispatcher, stream, asyncio.get_running_loop())
    submitting = replace(services, dispatcher=publisher) if publisher is not None else services

    def insert() -> tuple[str, int]:
        with services.session_factory() as session:
            job, _ = submit(session, submitting, tenant, body, idempotency_key, utcnow(),
                            responses_request=responses_request)
            return job.id, job.prompt_tokens or 0

    try:
        job_id, prompt_tokens = await run_in_threadpool(insert)
    except BaseException:
        if publisher is not None and publisher.subscription is not None:
            await publisher.subscription.close()
        raise
    return FollowedJob(job_id, publisher.subscription if publisher is not None else None, prompt_tokens)


async def follow(
    services: Services, job: FollowedJob, disconnected: Disconnected
) -> AsyncIterator[Generated | JobOutcome]:
    """Yields the current attempt's text so far of a choice each time it grows, then the final JobOutcome.

    Raises ClientGoneError when the client disconnects (the caller cancels the job)."""
    attempt, texts, tokens = 0, dict[int, str](), dict[int, int]()
    poll_s = STORE_POLL_S if job.subscription is not None else STORE_POLL_NO_STREAM_S
    next_read = time.monotonic() + poll_s
    while True:
        if await disconnected():
            raise ClientGoneError(job.job_id)
        try:
            event = await _next_event(job.subscription)
        except Exception as exc:  # e.g. Redis went away: the text still comes from the store at the end
            log.warning("token stream for %s failed (%s); polling the store", job.job_id, exc)
            await _drop_subscription(job)
            poll_s = STORE_POLL_NO_STREAM_S
            continue
        if event is not None and not event.end:
            if event.attempt != attempt:  # a redelivered job generates again from its first token
                attempt, texts, tokens = event.attempt, {}, {}
            texts[event.index] = texts.get(event.index, "") + event.text
            tokens[event.index] = max(tokens.get(event.index, 0), event.tokens)
            yield Generated(texts[event.index], sum(tokens.values()), event.index)
            continue
        if event is None and time.monotonic() < next_read:
            continue
        outcome = await run_in_threadpool(read_outcome, services, job.job_id)
        if outcome is not None and outcome.status in TERMINAL_STATUSES:
            yield outcome
            return
        next_read = time.monotonic() + poll_s


async def _drop_subscription(job: FollowedJob) -> None:
    subscription, job.subscription = job.subscription, None
    if subscription is not None:
        try:
            await subscription.close()
        except Exception as exc:
            log.debug("closing the token subscription of %s failed: %s", job.job_id, exc)


async def _next_event(subscription: Subscription | None) -> TokenEvent | None:
    if subscription is None:
        await asyncio.sleep(EVENT_WAIT_S)
        return None
    return await subscription.get(EVENT_WAIT_S)


async def finish(services: Services, job: FollowedJob, tenant: str, *, cancel: bool) -> None:
    """Cleanup that runs even while the request task is being cancelled (client gone)."""
    with anyio.CancelScope(shield=True):
        if cancel:
            await run_in_threadpool(cancel_job, services, job.job_id, tenant)
        await _drop_subscription(job)


async def wait_outcome(services: Services, tenant: str, job: FollowedJob, disconnected: Disconnected,
                       ) -> JobOutcome | None:
    """The job's outcome once it is final; None when the client went away first (the job is cancelled)."""
    outcome: JobOutcome | None = None
    try:
        async for item in follow(services, job, disconnected):
            if isinstance(item, JobOutcome):
                outcome = item
    except ClientGoneError:
        return None
    finally:
        await finish(services, job, tenant, cancel=outcome is None)
    return outcome


def outcome_error(outcome: JobOutcome) -> OpenAIError:
    """A job that did not succeed, as the matching OpenAI error."""
    detail = f"job {outcome.job_id} {outcome.status}"
    if outcome.error_code:
        detail += f": {outcome.error_code}: {outcome.error_message or ''}".rstrip(": ")
    if outcome.status == "expired":  # not started before the queue's deadline: overloaded, retry later
        return OpenAIError(503, detail, code="queue_deadline_exceeded", headers={"Retry-After": "1"})
    if outcome.status == "cancelled":
        return OpenAIError(409, detail, code="cancelled", headers=NO_RETRY)
    status = {"invalid_request": 400, "timeout": 504}.get(outcome.error_code or "", 500)
    return OpenAIError(status, detail, code=outcome.error_code or "job_failed", headers=NO_RETRY)


def read_outcome(services: Services, job_id: str) -> JobOutcome | None:
    with services.session_factory() as session:
        row = jobs.get(session, job_id)
        return JobOutcome.of(row) if row is not None else None


def cancel_job(services: Services, job_id: str, tenant: str) -> None:
    with services.session_factory() as session:
        job = jobs.cancel(session, job_id, tenant, utcnow())
    if job is not None and job.status == "cancelled":
        log.info("job %s cancelled: its client went away", job_id)
