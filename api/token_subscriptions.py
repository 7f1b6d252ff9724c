"""Celery mode: the API side of the token seam, one Redis pub/sub subscription per waiting request."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from redis import asyncio as aioredis

from conveyor.core.seams.token_stream import TokenEvent, channel

SUBSCRIBE_TIMEOUT_S = 5.0


class RedisSubscription:
    def __init__(self, pubsub: Any) -> None:
        self._pubsub = pubsub

    async def get(self, timeout_s: float) -> TokenEvent | None:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            message = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=left)
            if message is not None and message["type"] == "message":
                return TokenEvent.decode(message["data"])
        return None

    async def close(self) -> None:
        await self._pubsub.aclose()


class RedisTokenStream:
    """Subscribes on the broker's Redis; connections come from one pool bound to the app's event loop."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._client: aioredis.Redis | None = None

    async def subscribe(self, job_id: str) -> RedisSubscription:
        if self._client is None:
            self._client = aioredis.Redis.from_url(self._url, socket_connect_timeout=SUBSCRIBE_TIMEOUT_S)
        pubsub = self._client.pubsub()
        try:
            await pubsub.subscribe(channel(job_id))
            await asyncio.wait_for(_confirmed(pubsub), SUBSCRIBE_TIMEOUT_S)
        except BaseException:
            await pubsub.aclose()
            raise
        return RedisSubscription(pubsub)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


async def _confirmed(pubsub: Any) -> None:
    """Waits for Redis to acknowledge SUBSCRIBE: from then on, every PUBLISH to the channel reaches us."""
    while True:
        message = await pubsub.get_message(timeout=SUBSCRIBE_TIMEOUT_S)
        if message is not None and message["type"] == "subscribe":
            return
