"""Celery mode: the API side of the finished-jobs seam, ONE Redis subscriber per API process.

The subscriber listens on conveyor.core.seams.finish_notifications.CHANNEL and wakes this process's waiters of
the ids in each message. It starts with the first waiter (on the app's event loop), and after a Redis restart
subscribes again with backoff; meanwhile waiters read the store at their fallback interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from redis import asyncio as aioredis

from conveyor.core.seams.finish_notifications import CHANNEL, FinishedWaiter, LocalFinishedHub, decode

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
RETRY_MIN_S, RETRY_MAX_S = 0.5, 15.0


class RedisFinishedWatch:
    def __init__(self, url: str) -> None:
        self._url = url
        self._local = LocalFinishedHub()
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        self.subscribed = asyncio.Event()  # set while Redis has confirmed the subscription

    def watch(self, job_id: str) -> FinishedWaiter:
        self._listen_on(asyncio.get_running_loop())
        return self._local.watch(job_id)

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is None or task.done():
            return
        if task.get_loop() is not asyncio.get_running_loop():
            with contextlib.suppress(RuntimeError):  # that loop is closed: the task went with it
                task.get_loop().call_soon_threadsafe(task.cancel)
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def _listen_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """Starts the subscriber unless it runs on this loop already (another loop's has gone with it)."""
        if self._task is not None and not self._task.done() and self._task.get_loop() is loop:
            return
        self.subscribed = asyncio.Event()
        self._task = loop.create_task(self._listen(), name="finished-watch")

    async def _listen(self) -> None:
        delay = RETRY_MIN_S
        while True:
            try:
                await self._subscribe_and_wake()
            except Exception as exc:  # Redis down or restarted; waiters read the store meanwhile
                if self.subscribed.is_set():  # it was working: a new outage, retried quickly at first
                    delay = RETRY_MIN_S
                if not self._failing:
                    log.warning("finished-jobs watch: Redis subscription lost (%s); retrying", exc)
                self._failing = True
            self.subscribed.clear()
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)

    async def _subscribe_and_wake(self) -> None:
        client = aioredis.Redis.from_url(self._url, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                         socket_keepalive=True)
        pubsub = client.pubsub()
        try:
            await pubsub.subscribe(CHANNEL)
            async for message in pubsub.listen():
                if message["type"] == "subscribe":
                    self._confirmed()
                elif message["type"] == "message":
                    self._local.finished(decode(message["data"]))
        finally:
            await pubsub.aclose()
            await client.aclose()

    def _confirmed(self) -> None:
        if self._failing:
            log.info("finished-jobs watch: subscribed to Redis again")
            self._failing = False
        self.subscribed.set()
