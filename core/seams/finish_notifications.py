"""The seam that tells waiting clients a job reached a final status, so they need not poll the store.

Whoever commits a job's final status (the worker's runner, the API's cancel, the reconciler's expiry) calls
`FinishedSink.finished(job_ids)` after the commit. The API's long poll (`GET /v1/jobs/{id}?wait=S`) and its
event stream wait on a `FinishedWatch`. Notifications are a latency aid, never the record: a waiter re-reads
the store when woken and at a fallback interval, so a lost notification only delays an answer.

Implementations: `LocalFinishedHub` (one process: both the sink and the watch, embedded mode);
`RedisFinishedSink` (PUBLISH on one shared channel, used by the worker and the API's cancel) with the API's
one subscriber, api/finish_subscriber.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue as stdlib_queue
import threading
from typing import Protocol

import redis

from conveyor.core.background import BackgroundLoop

log = logging.getLogger(__name__)

CHANNEL = "conveyor:jobs-finished"  # one channel for every job: one message per group of finished jobs


class FinishedSink(Protocol):
    def finished(self, job_ids: list[str]) -> None:
        """These jobs' final status is committed. Never blocks and never raises."""


class FinishedWaiter(Protocol):
    async def wait(self, timeout_s: float) -> bool:
        """True as soon as the job was notified since the last call (or since the watch began), False after
        timeout_s without a notification."""

    def close(self) -> None: ...


class FinishedWatch(Protocol):
    def watch(self, job_id: str) -> FinishedWaiter:
        """Starts listening for one job at once: call it BEFORE reading the store, so a job that finishes
        between the read and the wait is not missed. Called on the event loop that will wait."""

    async def aclose(self) -> None:
        """Stops whatever listens in the background (on the app's shutdown)."""


def encode(job_ids: list[str]) -> str:
    return json.dumps(job_ids, separators=(",", ":"))


def decode(raw: str | bytes) -> list[str]:
    """The job ids of one message; none for a message that is not a list of ids."""
    try:
        data = json.loads(raw)
    except ValueError:
        return []
    return [item for item in data if isinstance(item, str)] if isinstance(data, list) else []


class _Waiter:
    """One waiting request: an asyncio event of its own loop, set from any thread."""

    def __init__(self, hub: LocalFinishedHub, job_id: str) -> None:
        self._hub = hub
        self._job_id = job_id
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()

    def notify(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            self._loop.call_soon_threadsafe(self._event.set)

    async def wait(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._event.wait(), timeout_s)
        except TimeoutError:
            return False
        self._event.clear()  # before the caller re-reads the store: a later notification is kept
        return True

    def close(self) -> None:
        self._hub.remove(self._job_id, self)


class LocalFinishedHub:
    """The waiters of one process, keyed by job id: a FinishedSink (any thread) and a FinishedWatch."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[str, set[_Waiter]] = {}

    def watch(self, job_id: str) -> _Waiter:
        waiter = _Waiter(self, job_id)
        with self._lock:
            self._waiters.setdefault(job_id, set()).add(waiter)
        return waiter

    def remove(self, job_id: str, waiter: _Waiter) -> None:
        with self._lock:
            waiters = self._waiters.get(job_id, set())
            waiters.discard(waiter)
            if not waiters:
                self._waiters.pop(job_id, None)

    def finished(self, job_ids: list[str]) -> None:
        with self._lock:
            woken = [w for job_id in job_ids for w in self._waiters.get(job_id, ())]
        for waiter in woken:
            waiter.notify()

    def waiting(self) -> int:
        """How many waiters are registered (all jobs together)."""
        with self._lock:
            return sum(len(waiters) for waiters in self._waiters.values())

    async def aclose(self) -> None:
        """Nothing runs in the background."""


class RedisFinishedSink:
    """PUBLISHes each call's ids as one message on CHANNEL, from its own thread: the caller (a job runner
    thread, a request) never waits on Redis. While Redis is unreachable, messages are dropped (waiters fall
    back to reading the store) and the outage is logged once."""

    def __init__(self, url: str) -> None:
        self._client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
        self._outbox: stdlib_queue.SimpleQueue[list[str] | None] = stdlib_queue.SimpleQueue()
        self._failing = False
        self._loop = BackgroundLoop("finished-publisher", lambda _stop: self._run(),
                                    wake=lambda: self._outbox.put(None))
        self._loop.start()

    def finished(self, job_ids: list[str]) -> None:
        if job_ids:
            self._outbox.put(list(job_ids))

    def close(self) -> None:
        """Publishes what is queued (within a few seconds), then stops."""
        self._loop.stop(timeout_s=5)
        self._client.close()

    def _run(self) -> None:
        while (job_ids := self._outbox.get()) is not None:
            try:
                self._client.publish(CHANNEL, encode(job_ids))
            except Exception as exc:
                self._failed(exc)
                if not self._drop_queued():
                    return
                continue
            if self._failing:
                log.info("finished-jobs notifications: Redis reachable again")
                self._failing = False

    def _failed(self, exc: Exception) -> None:
        if not self._failing:
            log.warning("finished-jobs notifications: publish failed (%s); waiters read the store until "
                        "Redis answers again", exc)
        self._failing = True

    def _drop_queued(self) -> bool:
        """Drops what queued up behind a failed publish (each would wait for the same timeout); False when
        close() was called meanwhile."""
        while True:
            try:
                if self._outbox.get_nowait() is None:
                    return False
            except stdlib_queue.Empty:
                return True
