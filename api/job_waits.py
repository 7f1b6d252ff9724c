"""Waiting on one job without holding a database session or a thread while nothing happens: the long poll
of `GET /v1/jobs/{id}?wait=S` and the event stream of `GET /v1/jobs/{id}/events`.

The waiter registers with the app's FinishedWatch BEFORE each store read, then sleeps until a notification,
the fallback interval or its own deadline, and reads again: the store is the truth, a notification only cuts
the wait short. Reads asked for together share one query (api/job_reads.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager

from conveyor.api.deps import Services
from conveyor.api.errors import lookup_id, not_found
from conveyor.core.lifecycle import TERMINAL_STATUSES
from conveyor.core.seams.finish_notifications import FinishedWaiter
from conveyor.core.seams.token_stream import Subscription, TokenEvent
from conveyor.core.views.public import JobPublic

MAX_WAIT_S = 60.0  # a long poll's longest wait: below common proxy and load-balancer idle timeouts
# Store reads while watched: a lost notification delays an answer by at most this. Not shorter: with hundreds
# of clients waiting (an open-loop burst), one re-read per waiter per second cost more than the jobs did.
FALLBACK_READ_S = 5.0
UNWATCHED_READ_S = 0.5  # store reads when no watch is wired (tests, a non-Redis broker)
EVENTS_MAX_S = 600.0  # an event stream ends after this long with the current state; clients reconnect
DELTA_READ_S = 1.0  # store reads of a job whose text is followed (no token event meanwhile)
KEEPALIVE_S = 15.0  # a comment line at least this often keeps proxies from closing an idle stream

Disconnected = Callable[[], Awaitable[bool]]


async def read(services: Services, job_id: str, tenant: str) -> JobPublic | None:
    """The job as the store has it now, or None if the tenant has no such job (read with the reads of other
    requests that asked at the same time: api/job_reads.py)."""
    return await services.job_reads.read(lookup_id("job", job_id), tenant)


async def read_or_404(services: Services, job_id: str, tenant: str) -> JobPublic:
    job = await read(services, job_id, tenant)
    if job is None:
        raise not_found("job", job_id)
    return job


async def until_final(
    services: Services, job_id: str, tenant: str, wait_s: float, disconnected: Disconnected
) -> JobPublic:
    """The job once final, or as it is after wait_s (or once the client is gone)."""
    deadline = time.monotonic() + wait_s
    with _watching(services, job_id) as pause:
        while True:
            job = await read_or_404(services, job_id, tenant)
            left = deadline - time.monotonic()
            if job.status in TERMINAL_STATUSES or left <= 0 or await disconnected():
                return job
            await pause(left)


async def events(services: Services, job_id: str, tenant: str, deltas: Subscription | None = None,
                 ) -> AsyncIterator[str]:
    """Server-sent events: the job now, then at each status change until final, and, with `deltas` (the
    job's token stream, subscribed before the first read), `event: delta` with each piece of text as it is
    generated; a keep-alive comment when quiet for KEEPALIVE_S; after EVENTS_MAX_S, the current state and
    the end. A job gone ends the stream."""
    deadline = time.monotonic() + EVENTS_MAX_S
    with _watching(services, job_id) as watched_pause:
        pause = watched_pause if deltas is None else _pause_on_deltas(deltas)
        job = await read(services, job_id, tenant)
        quiet_since = time.monotonic()
        if job is not None:
            yield job_event(job)
        while job is not None and job.status not in TERMINAL_STATUSES:
            now = time.monotonic()
            if now >= deadline:
                yield job_event(job)
                return
            delta = await pause(min(deadline, quiet_since + KEEPALIVE_S) - now)
            if isinstance(delta, TokenEvent) and delta.text and not delta.end:
                yield delta_event(delta)
                quiet_since = time.monotonic()
                continue
            latest = await read(services, job_id, tenant)
            if latest is not None and latest.status != job.status:
                yield job_event(latest)
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= KEEPALIVE_S:
                yield ": keep-alive\n\n"
                quiet_since = time.monotonic()
            job = latest


def job_event(job: JobPublic) -> str:
    return f"event: job\ndata: {job.model_dump_json()}\n\n"


def delta_event(event: TokenEvent) -> str:
    """New text of one choice of the running attempt (a requeued job streams again from its start)."""
    data = {"text": event.text, "index": event.index, "attempt": event.attempt, "tokens": event.tokens}
    return f"event: delta\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def _pause_on_deltas(deltas: Subscription) -> Callable[[float], Awaitable[object]]:
    """A pause that returns with the next token event (the end marker too), or after DELTA_READ_S (the
    store is read then: a status change shows within that), or after most_s."""
    async def pause(most_s: float) -> TokenEvent | None:
        return await deltas.get(max(0.0, min(DELTA_READ_S, most_s)))
    return pause


@contextmanager
def _watching(services: Services, job_id: str) -> Iterator[Callable[[float], Awaitable[object]]]:
    """`pause(most_s)`: returns on a notification of the job, after the fallback interval or after most_s,
    whichever comes first. Listening starts here, before the caller's first read."""
    watch = services.finished_watch
    if watch is None:
        yield lambda most_s: asyncio.sleep(min(UNWATCHED_READ_S, most_s))
        return
    waiter: FinishedWaiter = watch.watch(job_id)
    try:
        yield lambda most_s: waiter.wait(min(FALLBACK_READ_S, most_s))
    finally:
        waiter.close()
