"""A response's server-sent events (core/views/response_events.py): live while its job generates, or replayed
from the stored answer once it has ended.

A stream follows the job as the chat route's stream does (api/openai_sync.py: subscribed to its token stream
before it could start). A foreground response's job is cancelled when its client goes away; a background
response's job runs on, and GET ?stream=true resumes it: live when the job had not started yet, otherwise
once it ends, replayed from the store and numbered as the live stream was (`starting_after` skips what the
client has).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

from conveyor.api import openai_sync
from conveyor.api.deps import Services
from conveyor.api.openai_sync import ClientGoneError, FollowedJob, JobOutcome
from conveyor.api.response_jobs import forget, with_response
from conveyor.core.lifecycle import QUEUED, SCHEDULED, TERMINAL_STATUSES
from conveyor.core.protocol.chat_options import ChatOptions
from conveyor.core.store.tables import Job
from conveyor.core.views.response_events import ResponseEvents, after, replayed
from conveyor.core.views.response_objects import response_id, response_object
from conveyor.core.views.tool_calls import choice_seed
from conveyor.core.views.tool_stream import StreamDivergedError, answer_stream

log = logging.getLogger(__name__)
Disconnected = Callable[[], Awaitable[bool]]


@dataclass(frozen=True)
class StreamedResponse:
    """What a response's stream needs beyond its job: how its answer is read, the stop strings whose start
    is held back, and whether it lives on without its client (background) and is kept (store)."""

    options: ChatOptions
    stops: list[str]
    background: bool
    store: bool = True
    starting_after: int | None = None


async def live(services: Services, tenant: str, job: FollowedJob, shown: StreamedResponse,
               disconnected: Disconnected) -> AsyncIterator[str]:
    """The events of a response as its job generates, from its creation."""
    opened = await run_in_threadpool(_response, services, tenant, job.job_id, _opening_status(shown))
    events = ResponseEvents(job.job_id)
    answer = answer_stream(shown.options, choice_seed(job.job_id, 0))
    hold = max((len(stop) for stop in shown.stops), default=1) - 1  # a stop string's start may be cut
    outcome: JobOutcome | None = None
    yield _sse(events.opening(opened), shown.starting_after)
    try:
        async for item in openai_sync.follow(services, job, disconnected):
            if isinstance(item, JobOutcome):
                outcome = item
            elif item.index == 0:
                deltas = answer.update(item.text[: max(0, len(item.text) - hold)])
                yield _sse(events.deltas(deltas), shown.starting_after)
    except ClientGoneError:
        return
    finally:
        await openai_sync.finish(services, job, tenant, cancel=outcome is None and not shown.background)
    assert outcome is not None, "follow() ends with the outcome"
    try:
        yield _sse(events.deltas(answer.close(outcome.text or "")[0]), shown.starting_after)
    except StreamDivergedError:  # a retried job wrote otherwise: the done events carry the final text
        log.warning("response %s: the final text does not continue the streamed one", job.job_id)
    final = await run_in_threadpool(_response, services, tenant, job.job_id, None)
    yield _sse(events.closing(final), shown.starting_after)
    if not shown.store:
        await run_in_threadpool(forget, services, tenant, job.job_id)


async def resumed(services: Services, tenant: str, job: FollowedJob, shown: StreamedResponse,
                  disconnected: Disconnected, *, status: str) -> AsyncIterator[str]:
    """GET ?stream=true: live when the job (its `status` read once its token stream was subscribed) had not
    started, else its whole stream once it has ended, after `starting_after`."""
    if status in (SCHEDULED, QUEUED):
        async for event in live(services, tenant, job, shown, disconnected):
            yield event
        return
    try:
        if status not in TERMINAL_STATUSES:
            async for item in openai_sync.follow(services, job, disconnected):
                if isinstance(item, JobOutcome):
                    break
    except ClientGoneError:
        return
    finally:
        await openai_sync.finish(services, job, tenant, cancel=False)
    opened, final = await run_in_threadpool(_opened_and_final, services, tenant, job.job_id)
    yield _sse(replayed(job.job_id, opened, final), shown.starting_after)


def _opening_status(shown: StreamedResponse) -> str:
    return "queued" if shown.background else "in_progress"


def _response(services: Services, tenant: str, job_id: str, status: str | None) -> dict[str, Any]:
    def shown(job: Job) -> dict[str, Any]:
        return response_object(job, status=status)

    return with_response(services, tenant, response_id(job_id), shown)


def _opened_and_final(services: Services, tenant: str, job_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """An ended background response as it was created (queued) and as it ended, from one read."""
    def both(job: Job) -> tuple[dict[str, Any], dict[str, Any]]:
        return response_object(job, status="queued"), response_object(job)

    return with_response(services, tenant, response_id(job_id), both)


def _sse(events: list[dict[str, Any]], starting_after: int | None) -> str:
    shown = after(events, starting_after)
    return "".join(f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"
                   for event in shown)
