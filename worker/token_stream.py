"""The worker side of the token seam (api/token_stream.py): text deltas of running jobs, published per job.

`JobStreamer` turns the engine's per-step outputs into deltas, at most one per STREAM_EVERY_TOKENS tokens or
STREAM_EVERY_S seconds per job, and only for jobs someone listens to; sinks never block the engine thread.
Embedded mode: `InProcessTokenStream` is both the sink and the API's TokenStream (asyncio queues fed with
call_soon_threadsafe). Celery mode: `RedisTokenSink` publishes from its own thread on the job's channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue as stdlib_queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from api.token_stream import TokenEvent, channel
from engine.outputs import RequestOutput

log = logging.getLogger(__name__)

STREAM_EVERY_TOKENS = 4
STREAM_EVERY_S = 0.05


class TokenSink(Protocol):
    def listening(self, job_id: str) -> bool:
        """Whether publishing this job's deltas may reach anyone (a cheap, possibly stale answer)."""

    def publish(self, job_id: str, event: TokenEvent) -> None:
        """Never blocks and never raises: called from the engine thread."""


@dataclass
class _Progress:
    attempt: int
    sent_chars: int = 0
    unsent_tokens: int = 0
    last_sent: float = 0.0


class JobStreamer:
    """Per-job delta bookkeeping between the engine thread (update) and the finisher thread (end)."""

    def __init__(self, sink: TokenSink, clock: Callable[[], float] = time.monotonic) -> None:
        self._sink = sink
        self._clock = clock
        self._lock = threading.Lock()
        self._progress: dict[str, _Progress] = {}

    def update(self, job_id: str, attempt: int, out: RequestOutput) -> None:
        if not self._sink.listening(job_id):
            return
        with self._lock:
            progress = self._progress.setdefault(job_id, _Progress(attempt))
        progress.unsent_tokens += max(out.num_new_tokens, 1)
        now = self._clock()
        due = progress.unsent_tokens >= STREAM_EVERY_TOKENS or now - progress.last_sent >= STREAM_EVERY_S
        # NOTE: the text may shrink at the end (cut before a stop string); the API holds back enough
        # characters to cover that and reconciles with the stored text.
        delta = out.text[progress.sent_chars:]
        if delta and (due or out.finished):
            self._sink.publish(job_id, TokenEvent(attempt, delta))
            progress.sent_chars, progress.unsent_tokens, progress.last_sent = len(out.text), 0, now

    def end(self, job_id: str, attempt: int) -> None:
        """After the job's outcome is stored (or it was handed back): listeners read the store now."""
        with self._lock:
            self._progress.pop(job_id, None)
        self._sink.publish(job_id, TokenEvent(attempt, end=True))


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
    """Celery mode: PUBLISH on the job's channel from a background thread. A job whose first delta reached
    no subscriber gets no more deltas (nobody waits on it synchronously); its end marker is always sent."""

    def __init__(self, url: str) -> None:
        import redis

        self._client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
        self._outbox: stdlib_queue.SimpleQueue[tuple[str, TokenEvent] | None] = stdlib_queue.SimpleQueue()
        self._lock = threading.Lock()
        self._unheard: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="token-publisher", daemon=True)
        self._thread.start()

    def listening(self, job_id: str) -> bool:
        with self._lock:
            return job_id not in self._unheard

    def publish(self, job_id: str, event: TokenEvent) -> None:
        self._outbox.put((job_id, event))

    def close(self) -> None:
        self._outbox.put(None)
        self._thread.join(timeout=5)
        self._client.close()

    def _run(self) -> None:
        while (item := self._outbox.get()) is not None:
            job_id, event = item
            if not event.end and not self.listening(job_id):
                continue
            try:
                receivers = self._client.publish(channel(job_id), event.encode())
            except Exception as exc:  # the API falls back to the store; no more tries for this job's deltas
                log.debug("token publish for %s failed: %s", job_id, exc)
                receivers = 0
            with self._lock:
                if event.end:
                    self._unheard.discard(job_id)
                elif not receivers:
                    self._unheard.add(job_id)
