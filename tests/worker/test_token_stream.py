"""The worker side of the token seam: delta throttling, the in-process hub (embedded) and Redis pub/sub
(Celery mode) against a real Redis, read back through the API's RedisTokenStream."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from conveyor.api.token_subscriptions import RedisTokenStream
from conveyor.core.seams.token_stream import TokenEvent, channel
from conveyor.engine.outputs import RequestMetrics, RequestOutput
from conveyor.worker.streamer import STREAM_EVERY_S, STREAM_EVERY_TOKENS, JobStreamer
from conveyor.worker.token_sinks import UNHEARD_PROBE_S, InProcessTokenStream, RedisTokenSink
from tests.support.live_server import wait_for


class RecordingSink:
    def __init__(self, listening: bool = True) -> None:
        self.events: list[tuple[str, TokenEvent]] = []
        self.is_listening = listening

    def listening(self, job_id: str) -> bool:
        return self.is_listening

    def publish(self, job_id: str, event: TokenEvent) -> None:
        self.events.append((job_id, event))


def output(text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput("job_1#1", [1, 2], [3] * len(text), text, "length" if finished else None,
                         RequestMetrics(arrival_time=0.0), num_new_tokens=1)


def test_deltas_every_few_tokens_join_to_the_text_then_one_end_marker() -> None:
    sink, now = RecordingSink(), [100.0]
    streamer = JobStreamer(sink, clock=lambda: now[0])
    text = "abcdefghij"
    for i in range(1, len(text) + 1):
        streamer.update("job_1", 2, output(text[:i], finished=i == len(text)))
    streamer.end("job_1", 2)
    deltas = [e.text for _, e in sink.events if not e.end]
    # The first token goes at once (nothing sent yet), then one event per STREAM_EVERY_TOKENS, and the rest
    # when the job finishes.
    assert deltas == ["a", "bcde", "fghi", "j"] and STREAM_EVERY_TOKENS == 4
    # Each delta says how many tokens the attempt has generated so far (usage in every streamed chunk).
    assert [e.tokens for _, e in sink.events if not e.end] == [1, 5, 9, 10]
    assert sink.events[-1] == ("job_1", TokenEvent(2, end=True))
    assert {e.attempt for _, e in sink.events} == {2}


def test_a_slow_job_sends_each_token_once_the_interval_has_passed() -> None:
    sink, now = RecordingSink(), [100.0]
    streamer = JobStreamer(sink, clock=lambda: now[0])
    for i, text in enumerate(("a", "ab", "abc"), start=1):
        now[0] = 100.0 + i * 2 * STREAM_EVERY_S  # each update a full interval after the last
        streamer.update("job_1", 1, output(text))
    assert [e.text for _, e in sink.events] == ["a", "b", "c"]


def test_nothing_is_sent_for_a_job_nobody_listens_to_except_its_end() -> None:
    sink = RecordingSink(listening=False)
    streamer = JobStreamer(sink)
    streamer.update("job_1", 1, output("abc", finished=True))
    streamer.end("job_1", 1)
    assert sink.events == [("job_1", TokenEvent(1, end=True))]


def test_in_process_hub_delivers_events_from_another_thread() -> None:
    hub = InProcessTokenStream()

    async def scenario() -> list[TokenEvent | None]:
        assert not hub.listening("job_1")
        subscription = await hub.subscribe("job_1")
        assert hub.listening("job_1") and not hub.listening("job_2")
        sender = threading.Thread(target=lambda: [hub.publish("job_1", TokenEvent(1, "hi")),
                                                  hub.publish("job_2", TokenEvent(1, "other")),
                                                  hub.publish("job_1", TokenEvent(1, end=True))])
        sender.start()
        got = [await subscription.get(30), await subscription.get(30), await subscription.get(0.05)]
        sender.join()
        await subscription.close()
        assert not hub.listening("job_1")
        return got

    assert asyncio.run(scenario()) == [TokenEvent(1, "hi"), TokenEvent(1, end=True), None]


def test_redis_sink_to_the_api_subscription_and_unheard_jobs(redis_url: str) -> None:
    sink = RedisTokenSink(redis_url)
    stream = RedisTokenStream(redis_url)

    async def scenario() -> list[TokenEvent | None]:
        subscription = await stream.subscribe("job_1")
        sink.publish("job_1", TokenEvent(1, "hel", tokens=2))
        sink.publish("job_1", TokenEvent(1, "lo", tokens=3))
        sink.publish("job_1", TokenEvent(1, end=True))
        got = [await subscription.get(30) for _ in range(3)]
        await subscription.close()
        await stream.aclose()
        return got

    try:
        assert asyncio.run(scenario()) == [TokenEvent(1, "hel", tokens=2), TokenEvent(1, "lo", tokens=3),
                                           TokenEvent(1, end=True)]
        sink.publish("job_2", TokenEvent(1, "nobody listens"))
        sink.publish("job_3", TokenEvent(1, "nobody listens"))
        sink.publish("job_3", TokenEvent(1, end=True))
    finally:
        sink.close()  # handles everything queued, then stops
    assert not sink.listening("job_2")  # no subscriber got its delta: no deltas for a while
    assert sink.listening("job_1") and sink.listening("job_3")  # heard, or forgotten once ended


def test_redis_sink_tries_an_unheard_job_again_later(redis_url: str) -> None:
    now = [0.0]
    sink = RedisTokenSink(redis_url, clock=lambda: now[0])
    try:
        sink.publish("job_4", TokenEvent(1, "nobody listens yet"))
        wait_for(lambda: not sink.listening("job_4"), "the sink to find job_4 unheard", timeout_s=30)
        now[0] += UNHEARD_PROBE_S
        assert sink.listening("job_4")  # an event stream may have opened since: one more try
    finally:
        sink.close()


def test_redis_sink_with_redis_down_gives_up_on_a_job_after_one_try() -> None:
    with socket.socket() as s:  # a port nobody listens on: connections are refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sink = RedisTokenSink(f"redis://127.0.0.1:{port}/0")
    for text in ("a", "b", "c"):
        sink.publish("job_1", TokenEvent(1, text))
    sink.close()
    assert not sink.listening("job_1")


class HeldPipelines:
    """A Redis client whose pipelines record what they send; the first one's round trip waits for `go`, so
    that the events published meanwhile gather behind it."""

    def __init__(self) -> None:
        self.sent: list[list[str]] = []
        self.waiting = threading.Event()  # the first round trip has begun
        self.go = threading.Event()

    def pipeline(self, transaction: bool = True) -> HeldPipelines.Pipeline:
        assert not transaction, "PUBLISHes need no MULTI/EXEC"
        return HeldPipelines.Pipeline(self)

    def close(self) -> None: ...

    class Pipeline:
        def __init__(self, client: HeldPipelines) -> None:
            self._client = client
            self._channels: list[str] = []

        def publish(self, channel: str, _message: str) -> None:
            self._channels.append(channel)

        def execute(self) -> list[int]:
            if not self._client.sent:
                self._client.waiting.set()
                assert self._client.go.wait(30)
            self._client.sent.append(self._channels)
            return [1] * len(self._channels)


def test_redis_sink_sends_what_gathered_meanwhile_in_one_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    client = HeldPipelines()
    monkeypatch.setattr("redis.Redis.from_url", lambda *args, **kwargs: client)
    sink = RedisTokenSink("redis://unused")
    try:
        sink.publish("job_1", TokenEvent(1, "a"))
        assert client.waiting.wait(30)
        for job_id in ("job_2", "job_3", "job_1"):
            sink.publish(job_id, TokenEvent(1, end=True))
        client.go.set()
    finally:
        sink.close()
    assert client.sent == [[channel("job_1")], [channel("job_2"), channel("job_3"), channel("job_1")]]
