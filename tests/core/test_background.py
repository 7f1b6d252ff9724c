"""BackgroundLoop: a ticking loop ticks until stopped and survives a failing tick; a stop ends its wait at
once; a loop function sees the stop Event; `wake` unblocks an inbox loop; an unstarted loop stops at once."""

from __future__ import annotations

import queue as stdlib_queue
import threading
import time

import pytest

from conveyor.core.background import BackgroundLoop

WAIT_S = 10.0


def test_a_ticking_loop_keeps_ticking_after_a_failed_tick_and_a_stop_ends_its_wait_at_once() -> None:
    ticks: list[float] = []
    errors: list[Exception] = []
    third = threading.Event()

    def tick() -> None:
        ticks.append(time.monotonic())
        if len(ticks) == 3:
            third.set()
        if len(ticks) == 1:
            raise RuntimeError("the store is away")

    loop = BackgroundLoop.every("ticker", 0.01, tick, on_error=errors.append)
    loop.start()
    assert third.wait(WAIT_S), "the loop stopped ticking after the failed tick"
    loop.stop()  # ticks every 0.01 s: the count below would keep growing if it had not stopped
    count = len(ticks)
    time.sleep(0.05)

    assert [str(e) for e in errors] == ["the store is away"]
    assert len(ticks) == count and not loop.is_alive()
    slow = BackgroundLoop.every("slow", 3600.0, tick)
    slow.start()
    started = time.monotonic()
    assert slow.stop(timeout_s=WAIT_S) and time.monotonic() - started < WAIT_S  # not an hour


def test_a_loop_function_runs_on_a_named_daemon_thread_and_sees_the_stop_event() -> None:
    seen: list[tuple[str, bool]] = []

    def run(stop: threading.Event) -> None:
        thread = threading.current_thread()
        seen.append((thread.name, thread.daemon))
        stop.wait()

    loop = BackgroundLoop("named-loop", run)
    loop.start()
    assert loop.started and loop.is_alive() and not loop.stopping
    loop.request_stop()
    assert loop.stopping
    assert loop.join(WAIT_S)
    assert seen == [("named-loop", True)]


def test_wake_unblocks_an_inbox_loop_which_drains_what_came_before_its_marker() -> None:
    inbox: stdlib_queue.SimpleQueue[str | None] = stdlib_queue.SimpleQueue()
    handled: list[str] = []

    def drain() -> None:
        while (item := inbox.get()) is not None:
            handled.append(item)

    loop = BackgroundLoop("inbox", lambda _stop: drain(), wake=lambda: inbox.put(None))
    loop.start()
    inbox.put("a")
    inbox.put("b")
    assert loop.stop(timeout_s=WAIT_S)
    assert handled == ["a", "b"]


def test_an_unstarted_loop_stops_at_once_without_waking_anything() -> None:
    woken: list[bool] = []
    loop = BackgroundLoop("never-started", lambda stop: None, wake=lambda: woken.append(True))
    assert loop.stop(timeout_s=0.0) and not loop.started and woken == []


def test_an_exception_escaping_a_loop_function_ends_the_thread_and_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def run(_stop: threading.Event) -> None:
        raise ValueError("broken loop")

    loop = BackgroundLoop("breaks", run)
    loop.start()
    assert loop.join(WAIT_S)
    assert "background loop breaks ended on an error" in caplog.text and "broken loop" in caplog.text
