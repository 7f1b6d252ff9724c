"""The finished-jobs seam: the in-process hub (a sink for any thread, a watch for asyncio waiters) and the
Redis sink against the real Redis (one message per call, on the one shared channel; never blocking)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
import redis

from conveyor.core.seams.finish_notifications import (
    CHANNEL,
    LocalFinishedHub,
    RedisFinishedSink,
    decode,
    encode,
)
from tests.support.live_server import SpareRedis, wait_for


def test_ids_round_trip_and_junk_is_no_ids() -> None:
    assert decode(encode(["job_a", "job_b"])) == ["job_a", "job_b"]
    assert decode(b'["job_a"]') == ["job_a"]
    assert decode("not json") == [] and decode('{"a": 1}') == [] and decode('["a", 2]') == ["a"]


async def test_a_finish_in_another_thread_wakes_that_jobs_waiters_only() -> None:
    hub = LocalFinishedHub()
    first, second, other = hub.watch("job_a"), hub.watch("job_a"), hub.watch("job_b")
    threading.Thread(target=hub.finished, args=(["job_a", "job_x"],)).start()
    assert await first.wait(5) and await second.wait(5)
    assert not await other.wait(0.2)
    assert not await first.wait(0.05)  # the notification was consumed: the next wait waits again
    for waiter in (first, second, other):
        waiter.close()
    assert hub.waiting() == 0


async def test_a_finish_between_watch_and_wait_is_not_lost() -> None:
    hub = LocalFinishedHub()
    waiter = hub.watch("job_a")
    hub.finished(["job_a"])  # as if the job finished while the waiter read the store
    started = time.monotonic()
    assert await waiter.wait(5) and time.monotonic() - started < 1
    waiter.close()


def test_finishing_with_nobody_waiting_or_a_closed_loop_is_harmless() -> None:
    hub = LocalFinishedHub()
    hub.finished(["job_a"])

    async def watch_then_leave() -> None:
        hub.watch("job_a")  # never closed: its loop ends with asyncio.run

    asyncio.run(watch_then_leave())
    hub.finished(["job_a"])  # the waiter's loop is closed: nothing raises


def test_redis_sink_publishes_one_message_per_call_on_the_shared_channel(spare_redis: SpareRedis) -> None:
    # A private redis-server: pub/sub channels span a server's databases, so on the shared one another test
    # process's finished jobs arrived on this channel too (a parallel run failed so).
    spare_redis.start()
    redis_url = spare_redis.url
    client = redis.Redis.from_url(redis_url)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(CHANNEL)
    pubsub.get_message(timeout=5)  # the subscribe confirmation
    sink = RedisFinishedSink(redis_url)
    try:
        sink.finished(["job_a", "job_b"])
        sink.finished([])  # nothing finished: nothing sent
        sink.finished(["job_c"])
        received = [_next_message(pubsub), _next_message(pubsub)]
        assert received == [["job_a", "job_b"], ["job_c"]]
        assert pubsub.get_message(timeout=0.3) is None
    finally:
        sink.close()
        pubsub.close()
        client.close()


def test_redis_sink_never_blocks_nor_raises_while_redis_is_down_and_logs_it_once(
    spare_redis: SpareRedis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="conveyor.core.seams.finish_notifications")
    sink = RedisFinishedSink(spare_redis.url)  # not started: connections are refused
    started = time.monotonic()
    for i in range(20):
        sink.finished([f"job_{i}"])
    assert time.monotonic() - started < 0.1
    wait_for(lambda: "publish failed" in caplog.text, "the outage to be logged", timeout_s=10)
    spare_redis.start()
    client = redis.Redis.from_url(spare_redis.url)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(CHANNEL)
    pubsub.get_message(timeout=5)
    try:
        sink.finished(["job_back"])
        assert _next_message(pubsub) == ["job_back"]
        wait_for(lambda: "reachable again" in caplog.text, "the recovery to be logged", timeout_s=10)
        assert caplog.text.count("publish failed") == 1
    finally:
        sink.close()
        pubsub.close()
        client.close()


def _next_message(pubsub: redis.client.PubSub) -> list[str]:
    message = pubsub.get_message(timeout=5)
    assert message is not None and message["channel"] == CHANNEL.encode()
    return decode(message["data"])

