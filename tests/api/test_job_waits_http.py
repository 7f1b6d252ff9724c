"""Clients that wait: the long poll `GET /v1/jobs/{id}?wait=S` and the event stream
`GET /v1/jobs/{id}/events`, with the store playing the worker's part and the in-process hub (or a watch that
never notifies, or Redis between two API processes) telling the API that jobs finished."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from conveyor.api import job_waits
from conveyor.api.app import create_app
from conveyor.api.finish_subscriber import RedisFinishedWatch
from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.core.clock import utcnow
from conveyor.core.seams.finish_notifications import (
    FinishedSink,
    FinishedWatch,
    LocalFinishedHub,
    RedisFinishedSink,
)
from conveyor.core.settings import Settings
from conveyor.core.store import jobs
from tests.support.live_server import serving
from tests.support.service import LOCAL_URL, RecordingPublisher, Service, error_of

NOT_NOTIFIED_S = 30.0  # the fallback read interval in tests that must be answered by a notification


class NeverNotified:
    """A FinishedWatch whose waiters are never woken: only the fallback store reads can answer."""

    def watch(self, job_id: str) -> NeverNotified:
        return self

    async def wait(self, timeout_s: float) -> bool:
        await asyncio.sleep(timeout_s)
        return False

    def close(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


class RecordingSink:
    def __init__(self, inner: FinishedSink) -> None:
        self.inner = inner
        self.calls: list[list[str]] = []

    def finished(self, job_ids: list[str]) -> None:
        self.calls.append(job_ids)
        self.inner.finished(job_ids)


@pytest.fixture
def make_app(
    database_url: str, make_settings: Callable[..., Settings], prompt_tokenizer: PromptTokenizer,
    session_factory: sessionmaker[Session],
) -> Iterator[Callable[..., Service]]:
    """An app wired with `watch` and `sink`, as `conveyor serve` (the hub as both) or `conveyor api` does."""
    clients: list[TestClient] = []

    def make(watch: FinishedWatch | None, sink: FinishedSink | None = None) -> Service:
        settings = make_settings(database_url=database_url)
        publisher = RecordingPublisher()
        app = create_app(settings, publisher=publisher, tokenizer=prompt_tokenizer, finished_watch=watch,
                         finished_sink=sink)
        http = TestClient(app, base_url=LOCAL_URL)
        http.__enter__()
        clients.append(http)
        return Service(settings, publisher, http, session_factory)

    yield make
    for c in clients:
        c.__exit__(None, None, None)


@pytest.fixture
def hub() -> LocalFinishedHub:
    return LocalFinishedHub()


def submit(client: TestClient) -> str:
    r = client.post("/v1/jobs", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 202, r.text
    job_id: str = r.json()["id"]
    return job_id


def complete(service: Service, job_id: str) -> None:
    """The worker's part: claim, then commit the outcome (no notification)."""
    with service.session_factory() as s:
        assert jobs.claim(s, job_id, "w", utcnow()) is not None
        assert jobs.complete(s, job_id, 1, result_text="done", finish_reason="stop", prompt_tokens=1,
                             completion_tokens=1, preemptions=0, first_token_at=None, now=utcnow())


def later(delay_s: float, *steps: Callable[[], object]) -> threading.Thread:
    def run() -> None:
        time.sleep(delay_s)
        for step in steps:
            step()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def long_poll(client: TestClient, job_id: str, wait: float) -> tuple[dict[str, Any], float]:
    started = time.monotonic()
    r = client.get(f"/v1/jobs/{job_id}", params={"wait": wait})
    assert r.status_code == 200, r.text
    return r.json(), time.monotonic() - started


def test_long_poll_answers_as_soon_as_the_job_finishes(
    make_app: Callable[..., Service], hub: LocalFinishedHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(job_waits, "FALLBACK_READ_S", NOT_NOTIFIED_S)
    service = make_app(hub, hub)
    alice = service.client("alice")
    job_id = submit(alice)
    worker = later(0.3, lambda: complete(service, job_id), lambda: hub.finished([job_id]))
    job, took = long_poll(alice, job_id, 20)
    worker.join()
    assert job["status"] == "succeeded" and job["result"]["text"] == "done"
    assert 0.3 <= took < 5  # woken by the notification, long before the wait or a fallback read
    assert hub.waiting() == 0


def test_long_poll_answers_the_current_state_after_the_wait(
    make_app: Callable[..., Service], hub: LocalFinishedHub
) -> None:
    alice = make_app(hub, hub).client("alice")
    job_id = submit(alice)
    job, took = long_poll(alice, job_id, 0.4)
    assert job["status"] == "queued" and job["id"] == job_id
    assert 0.4 <= took < 3


def test_long_poll_of_a_final_job_answers_at_once(
    make_app: Callable[..., Service], hub: LocalFinishedHub
) -> None:
    service = make_app(hub, hub)
    alice = service.client("alice")
    job_id = submit(alice)
    complete(service, job_id)
    job, took = long_poll(alice, job_id, 60)
    assert job["status"] == "succeeded" and took < 2


def test_without_any_notification_the_fallback_read_answers(make_app: Callable[..., Service]) -> None:
    service = make_app(NeverNotified())
    alice = service.client("alice")
    job_id = submit(alice)
    worker = later(0.2, lambda: complete(service, job_id))
    job, took = long_poll(alice, job_id, 20)
    worker.join()
    assert job["status"] == "succeeded"
    assert took < job_waits.FALLBACK_READ_S + 3


def test_without_a_watch_the_long_poll_reads_the_store(make_app: Callable[..., Service]) -> None:
    service = make_app(None)
    alice = service.client("alice")
    job_id = submit(alice)
    worker = later(0.2, lambda: complete(service, job_id))
    job, took = long_poll(alice, job_id, 20)
    worker.join()
    assert job["status"] == "succeeded" and took < 5


@pytest.mark.parametrize("wait", ["0", "-1", "60.5", "1e9", "abc", "nan", "inf"])
def test_wait_outside_0_to_60_seconds_is_422_naming_it(
    make_app: Callable[..., Service], hub: LocalFinishedHub, wait: str
) -> None:
    alice = make_app(hub, hub).client("alice")
    job_id = submit(alice)
    r = alice.get(f"/v1/jobs/{job_id}?wait={wait}")
    assert r.status_code == 422, r.text
    error = error_of(r)
    assert error["field"] == "wait" and error["message"].startswith("wait: ")


def test_without_wait_the_job_is_read_at_once(
    make_app: Callable[..., Service], hub: LocalFinishedHub
) -> None:
    alice = make_app(hub, hub).client("alice")
    job_id = submit(alice)
    started = time.monotonic()
    r = alice.get(f"/v1/jobs/{job_id}")
    assert r.status_code == 200 and r.json()["status"] == "queued" and time.monotonic() - started < 2


def test_another_tenants_job_is_404_at_once_with_wait_and_events(
    make_app: Callable[..., Service], hub: LocalFinishedHub
) -> None:
    service = make_app(hub, hub)
    job_id = submit(service.client("alice"))
    bob = service.client("bob")
    started = time.monotonic()
    for url in (f"/v1/jobs/{job_id}?wait=60", f"/v1/jobs/{job_id}/events", "/v1/jobs/job_nope/events"):
        r = bob.get(url)
        assert r.status_code == 404 and error_of(r)["code"] == "not_found", r.text
    assert time.monotonic() - started < 5
    assert service.http.get(f"/v1/jobs/{job_id}/events").status_code == 401


def test_the_apis_cancel_tells_the_sink_and_wakes_the_long_poll(
    make_app: Callable[..., Service], hub: LocalFinishedHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(job_waits, "FALLBACK_READ_S", NOT_NOTIFIED_S)
    sink = RecordingSink(hub)
    service = make_app(hub, sink)
    alice = service.client("alice")
    job_id = submit(alice)
    canceller = later(0.3, lambda: alice.post(f"/v1/jobs/{job_id}/cancel"))
    job, took = long_poll(alice, job_id, 20)
    canceller.join()
    assert job["status"] == "cancelled" and took < 5
    assert sink.calls == [[job_id]]


def test_a_cancel_in_one_api_process_wakes_a_long_poll_in_another(
    make_app: Callable[..., Service], redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(job_waits, "FALLBACK_READ_S", NOT_NOTIFIED_S)
    sinks = [RedisFinishedSink(redis_url), RedisFinishedSink(redis_url)]
    watches = [RedisFinishedWatch(redis_url), RedisFinishedWatch(redis_url)]
    first, second = (make_app(w, s) for w, s in zip(watches, sinks, strict=True))
    try:
        job_id = submit(first.client("alice"))
        first.client("alice").get(f"/v1/jobs/{job_id}?wait=0.5")  # starts the first API's subscriber
        canceller = later(0.5, lambda: second.client("alice").post(f"/v1/jobs/{job_id}/cancel"))
        job, took = long_poll(first.client("alice"), job_id, 20)
        canceller.join()
        assert job["status"] == "cancelled" and took < 5
    finally:
        for sink in sinks:
            sink.close()


def test_events_stream_the_state_at_once_then_each_change_until_final(
    make_app: Callable[..., Service], hub: LocalFinishedHub, prompt_tokenizer: PromptTokenizer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(job_waits, "FALLBACK_READ_S", NOT_NOTIFIED_S)
    service = make_app(hub, hub)
    alice = service.client("alice")
    job_id = submit(alice)
    app = create_app(service.settings, publisher=RecordingPublisher(), tokenizer=prompt_tokenizer,
                     finished_watch=hub, finished_sink=hub)
    headers = {"Authorization": alice.headers["Authorization"]}
    with (serving(app) as url, httpx.Client(base_url=url, headers=headers, timeout=10) as http,
          http.stream("GET", f"/v1/jobs/{job_id}/events") as r):
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _events(r.iter_lines())
        assert next(events)["status"] == "queued"  # before anything changed: sent at once
        with service.session_factory() as s:
            assert jobs.claim(s, job_id, "w", utcnow()) is not None
        hub.finished([job_id])  # a spurious wake-up: the stream re-reads and sees `running`
        assert next(events)["status"] == "running"
        with service.session_factory() as s:
            jobs.complete(s, job_id, 1, result_text="done", finish_reason="stop", prompt_tokens=1,
                          completion_tokens=1, preemptions=0, first_token_at=None, now=utcnow())
        hub.finished([job_id])
        final = next(events)
        assert final["status"] == "succeeded" and final["result"]["text"] == "done"
        assert list(events) == []  # the stream ended after the final state


def test_events_of_a_final_job_are_one_event(make_app: Callable[..., Service], hub: LocalFinishedHub) -> None:
    service = make_app(hub, hub)
    alice = service.client("alice")
    job_id = submit(alice)
    complete(service, job_id)
    r = alice.get(f"/v1/jobs/{job_id}/events")
    assert r.status_code == 200
    assert [e["status"] for e in _events(r.iter_lines())] == ["succeeded"]


def test_events_keep_alive_then_end_after_the_maximum_duration_with_the_current_state(
    make_app: Callable[..., Service], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(job_waits, "EVENTS_MAX_S", 1.0)
    monkeypatch.setattr(job_waits, "KEEPALIVE_S", 0.3)
    monkeypatch.setattr(job_waits, "FALLBACK_READ_S", 0.1)
    service = make_app(NeverNotified())
    alice = service.client("alice")
    job_id = submit(alice)
    started = time.monotonic()
    r = alice.get(f"/v1/jobs/{job_id}/events")
    assert 1.0 <= time.monotonic() - started < 5
    lines = r.text.splitlines()
    assert lines.count(": keep-alive") >= 2
    assert [e["status"] for e in _events(iter(lines))] == ["queued", "queued"]


def _events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """The `data` of each `event: job` of a server-sent event stream."""
    name = None
    for line in lines:
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            assert name == "job"
            yield json.loads(line.removeprefix("data: "))



def test_the_openapi_document_describes_wait_and_the_event_stream(service: Service) -> None:
    spec = service.http.app.openapi()  # type: ignore[attr-defined]
    read = spec["paths"]["/v1/jobs/{job_id}"]["get"]
    wait = next(p for p in read["parameters"] if p["name"] == "wait")
    number = wait["schema"]["anyOf"][0]
    assert (number["exclusiveMinimum"], number["maximum"]) == (0, 60) and "long poll" in wait["description"]
    assert "422" in read["responses"]
    events = spec["paths"]["/v1/jobs/{job_id}/events"]["get"]
    assert list(events["responses"]["200"]["content"]) == ["text/event-stream"]
    assert list(events["responses"]["404"]["content"]) == ["application/json"]
    assert "Server-sent events" in events["description"]
