"""Where running jobs' text deltas go: an in-process hub (embedded mode) or Redis pub/sub (Celery mode).

Embedded mode: `InProcessTokenStream` is both the worker's sink and the API's TokenStream (asyncio queues fed
with call_soon_threadsafe). Celery mode: `RedisTokenSink` publishes from its own thread on the job's channel;
the API subscribes with api/token_subscriptions.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue as stdlib_queue
import threading
import time
from collections.abc import Callable

from conveyor.core.background import BackgroundLoop
from conveyor.core.seams.token_stream import TokenEvent, channel

log = logging.getLogger(__name__)
UNHEARD_PROBE_S = 1.0  # a job nobody listened to: how long before its deltas are tried again
PUBLISH_BATCH = 256  # events sent in one round trip at most


class _Subscriber:
    def __init__(self, hub: InProcessTokenStream, job_id: str) -> None:
        self._hub = hub
        self._job_id = job_id
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

    def push(self, event: TokenEvent) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def get(self, timeout_s: float) -> TokenEvent | None:
        try:
            return await asyncio.wait_for(self._queue.get(), timeout_s)
        except TimeoutError:
            return None

    async def close(self) -> None:
        self._hub.remove(self._job_id, self)


class InProcessTokenStream:
    """Embedded mode: a thread-safe in-process pub/sub, both the worker's sink and the API's TokenStream."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subscribers: dict[str, list[_Subscriber]] = {}

    async def subscribe(self, job_id: str) -> _Subscriber:
        subscriber = _Subscriber(self, job_id)
        with self._lock:
            self._subscribers.setdefault(job_id, []).append(subscriber)
        return subscriber

    def remove(self, job_id: str, subscriber: _Subscriber) -> None:
        with self._lock:
            listeners = self._subscribers.get(job_id, [])
            if subscriber in listeners:
                listeners.remove(subscriber)
            if not listeners:
                self._subscribers.pop(job_id, None)

    def listening(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._subscribers

    def publish(self, job_id: str, event: TokenEvent) -> None:
        with self._lock:
            listeners = list(self._subscribers.get(job_id, ()))
        for subscriber in listeners:
            subscriber.push(event)


class RedisTokenSink:
    """Celery mode: PUBLISH on the job's channel from a background thread, whatever has gathered in one
    round trip (a pipeline). A job whose delta reached no subscriber gets no deltas for UNHEARD_PROBE_S, then
    one more try (someone may have opened its event stream since: GET /v1/jobs/{id}/events); its end marker
    is always sent."""

    def __init__(self, url: str, clock: Callable[[], float] = time.monotonic) -> None:
        import redis

        self._client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
        self._outbox: stdlib_queue.SimpleQueue[tuple[str, TokenEvent] | None] = stdlib_queue.SimpleQueue()
        self._lock = threading.Lock()
        self._clock = clock
        self._unheard: dict[str, float] = {}  # job id -> when its deltas are tried again
        self._loop = BackgroundLoop("token-publisher", lambda _stop: self._run(),
                                    wake=lambda: self._outbox.put(None))
        self._loop.start()

    def listening(self, job_id: str) -> bool:
        with self._lock:
            retry_at = self._unheard.get(job_id)
        return retry_at is None or self._clock() >= retry_at

    def publish(self, job_id: str, event: TokenEvent) -> None:
        self._outbox.put((job_id, event))

    def close(self) -> None:
        """Publishes what is queued (within a few seconds), then stops."""
        self._loop.stop(timeout_s=5)
        self._client.close()

    def _run(self) -> None:
        stopping = False
        while not stopping:
            batch, stopping = self._gather(self._outbox.get())
            if batch:
                self._send(batch)

    def _gather(self, first: tuple[str, TokenEvent] | None) -> tuple[list[tuple[str, TokenEvent]], bool]:
        """`first` and what is already queued behind it, without the deltas of jobs nobody hears; and
        whether the stop marker came."""
        batch: list[tuple[str, TokenEvent]] = []
        item = first
        while item is not None:
            job_id, event = item
            if event.end or self.listening(job_id):
                batch.append(item)
            if len(batch) >= PUBLISH_BATCH:
                return batch, False
            try:
                item = self._outbox.get_nowait()
            except stdlib_queue.Empty:
                return batch, False
        return batch, True

    def _send(self, batch: list[tuple[str, TokenEvent]]) -> None:
        try:
            pipeline = self._client.pipeline(transaction=False)
            for job_id, event in batch:
                pipeline.publish(channel(job_id), event.encode())
            receivers = pipeline.execute()
        except Exception as exc:  # the API falls back to the store; no more tries for these jobs' deltas
            log.debug("token publish of %d event(s) failed: %s", len(batch), exc)
            receivers = [0] * len(batch)
        retry_at = self._clock() + UNHEARD_PROBE_S
        with self._lock:
            for (job_id, event), heard in zip(batch, receivers, strict=True):
                if event.end or heard:
                    self._unheard.pop(job_id, None)
                else:
                    self._unheard[job_id] = retry_at
