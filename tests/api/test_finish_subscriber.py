"""The API's one Redis subscriber for finished jobs, against a real Redis: the worker's (or another API's)
RedisFinishedSink publishes, waiters of those ids wake and no others; a Redis restart is survived."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

import pytest

from conveyor.api import finish_subscriber
from conveyor.api.finish_subscriber import RedisFinishedWatch
from conveyor.core.seams.finish_notifications import RedisFinishedSink
from tests.support.live_server import SpareRedis

SUBSCRIBE_S = 10.0


def test_a_published_group_wakes_its_jobs_waiters_in_another_thread_and_no_others(redis_url: str) -> None:
    watching = threading.Event()
    woken: dict[str, bool] = {}

    async def api_process() -> None:
        watch = RedisFinishedWatch(redis_url)
        waiters = {job_id: watch.watch(job_id) for job_id in ("job_a", "job_b", "job_c")}
        await asyncio.wait_for(watch.subscribed.wait(), SUBSCRIBE_S)
        watching.set()
        woken["job_a"] = await waiters["job_a"].wait(10)
        woken["job_b"] = await waiters["job_b"].wait(0.01)
        woken["job_c"] = await waiters["job_c"].wait(0.5)
        for waiter in waiters.values():
            waiter.close()
        await watch.aclose()

    thread = threading.Thread(target=asyncio.run, args=(api_process(),))
    thread.start()
    sink = RedisFinishedSink(redis_url)
    try:
        assert watching.wait(SUBSCRIBE_S + 5)
        sink.finished(["job_a", "job_b", "job_unwatched"])
        thread.join(30)
    finally:
        sink.close()
    assert woken == {"job_a": True, "job_b": True, "job_c": False}


async def test_the_watch_subscribes_again_after_a_redis_restart_and_says_so_once(
    spare_redis: SpareRedis, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(finish_subscriber, "RETRY_MAX_S", 0.5)
    caplog.set_level(logging.INFO, logger="conveyor.api.finish_subscriber")
    spare_redis.start()
    watch = RedisFinishedWatch(spare_redis.url)
    sink = RedisFinishedSink(spare_redis.url)
    waiter = watch.watch("job_a")
    try:
        await asyncio.wait_for(watch.subscribed.wait(), SUBSCRIBE_S)
        spare_redis.stop()
        await _until(lambda: not watch.subscribed.is_set())
        await asyncio.sleep(1.5)  # several refused retries
        await asyncio.to_thread(spare_redis.start)
        await asyncio.wait_for(watch.subscribed.wait(), SUBSCRIBE_S)
        sink.finished(["job_a"])
        assert await waiter.wait(10)
    finally:
        waiter.close()
        await watch.aclose()
        sink.close()
    assert caplog.text.count("subscription lost") == 1 and "subscribed to Redis again" in caplog.text


async def test_closing_the_watch_stops_its_subscriber(redis_url: str) -> None:
    watch = RedisFinishedWatch(redis_url)
    waiter = watch.watch("job_a")
    await asyncio.wait_for(watch.subscribed.wait(), SUBSCRIBE_S)
    waiter.close()
    await watch.aclose()
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "finished-watch"]


async def _until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.02)
