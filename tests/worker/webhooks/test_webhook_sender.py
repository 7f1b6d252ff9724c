"""The sender's passes on SQLite and Postgres: one delivery's failure never stops the others, a payload that
can never be sent fails for good with its reason, and a stalled receiver does not hold up another one."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

import conveyor.worker.webhooks.delivery
from conveyor.core.clock import utcnow
from conveyor.core.store import webhooks
from conveyor.core.store.tables import Attempt, Delivery
from conveyor.core.webhooks.events import build_event
from conveyor.worker.webhooks.sender import POLL_S, WebhookSender
from tests.support.webhook_receiver import Receiver, Reply
from tests.support.webhook_service import WebhookService

# How long the stalled receiver takes to answer each request: far above the scheduling hiccups of a loaded
# 2-core machine (the other receiver once answered after 2.09 s there, against a 1.5 s bound), so that waiting
# behind one stall (>= STALL_S) and a late thread (< STALL_S / 2 + a pass) cannot be mistaken for each other.
STALL_S = 4.0


def _deliveries(service: WebhookService, tenant: str, job_id: str) -> list[tuple[Delivery, list[Attempt]]]:
    with service.sessions() as session:
        found = webhooks.for_subject(session, tenant, "job", job_id)
        attempts = webhooks.attempts_of(session, [d.id for d in found])
    return [(d, attempts[d.id]) for d in found]


def _finished_job(service: WebhookService, client: Any, **fields: Any) -> str:
    """A job submitted over the API and completed in the store."""
    job_id = service.submit(client, **fields)
    service.succeed(job_id, utcnow())
    return job_id


def _unencodable_delivery(service: WebhookService, url: str) -> str:
    """A delivery whose frozen event holds a lone surrogate: valid JSON text (an escape, as a batch line's
    custom_id may carry it) that no UTF-8 body can carry. Returns the subject's id."""
    now = utcnow()
    data = {"id": "job_unencodable", "status": "succeeded", "metadata": {"custom_id": "\udfff"}}
    with service.sessions() as session:
        webhooks.add_delivery(session, tenant_id="alice", subscription_id=None, url=url,
                              event=build_event("job.succeeded", data, now), subject_type="job",
                              subject_id="job_unencodable", now=now)
        session.commit()
    return "job_unencodable"


def test_a_payload_that_cannot_be_encoded_fails_for_good_and_the_pass_goes_on(
    webhook_service: WebhookService, receiver: Receiver,
) -> None:
    alice = webhook_service.client("alice")
    bad = _unencodable_delivery(webhook_service, receiver.url)
    good = _finished_job(webhook_service, alice, webhook=receiver.url)
    now = utcnow()

    assert webhook_service.sender.tick(now) == 2

    [(failed, [attempt])] = _deliveries(webhook_service, "alice", bad)
    assert (failed.status, failed.next_attempt_at, attempt.outcome) == ("failed", None, "failed")
    assert failed.last_error is not None
    assert failed.last_error.startswith("payload cannot be encoded as JSON: ")
    assert attempt.error == failed.last_error
    [(delivered, _)] = _deliveries(webhook_service, "alice", good)
    assert delivered.status == "delivered"
    assert [r.headers["webhook-id"] for r in receiver.received] == [delivered.id]
    assert webhook_service.sender.tick(now + timedelta(days=4)) == 0   # never retried


def test_an_unexpected_error_is_recorded_against_its_delivery_alone(
    webhook_service: WebhookService, receiver: Receiver, monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = conveyor.worker.webhooks.delivery.deliver

    def deliver(url: str, *args: Any, **kwargs: Any) -> Any:
        if url.endswith("?boom"):
            raise RuntimeError("boom")
        return real(url, *args, **kwargs)

    monkeypatch.setattr("conveyor.worker.webhooks.sender.deliver", deliver)
    alice = webhook_service.client("alice")
    broken = _finished_job(webhook_service, alice, webhook=receiver.url + "?boom")
    fine = _finished_job(webhook_service, alice, webhook=receiver.url)
    now = utcnow()

    assert webhook_service.sender.tick(now) == 2

    [(retrying, [attempt])] = _deliveries(webhook_service, "alice", broken)
    assert (retrying.status, attempt.outcome) == ("pending", "retry")
    assert attempt.error == retrying.last_error == "unexpected error: RuntimeError: boom"
    assert retrying.next_attempt_at is not None
    assert timedelta(seconds=4) <= retrying.next_attempt_at - now <= timedelta(seconds=6)   # the schedule
    [(delivered, _)] = _deliveries(webhook_service, "alice", fine)
    assert delivered.status == "delivered" and len(receiver.received) == 1


@pytest.fixture
def stalled() -> Iterator[Receiver]:
    server = Receiver()
    server.replies = [Reply(delay_s=STALL_S), Reply(delay_s=STALL_S)]
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_a_stalled_receiver_does_not_hold_up_another(
    webhook_service: WebhookService, receiver: Receiver, stalled: Receiver,
) -> None:
    alice = webhook_service.client("alice")
    first_slow = _finished_job(webhook_service, alice, webhook=stalled.url)   # due first
    second_slow = _finished_job(webhook_service, alice, webhook=stalled.url)
    _finished_job(webhook_service, alice, webhook=receiver.url)
    settings = webhook_service.settings.model_copy(update={"webhook_timeout_s": 2 * STALL_S})
    sender = WebhookSender(webhook_service.sessions, settings)
    started = time.monotonic()
    sender.start()
    try:
        while len(stalled.received) < 2 and time.monotonic() - started < 4 * STALL_S:
            time.sleep(0.01)
    finally:
        sender.stop()

    [fast] = receiver.received
    assert fast.at - started < POLL_S + STALL_S / 2, f"the other receiver waited {fast.at - started:.2f} s"
    first, second = stalled.received
    assert second.at - first.at >= STALL_S * 0.9   # one request at a time per receiver
    expected = [_deliveries(webhook_service, "alice", job)[0][0].id for job in (first_slow, second_slow)]
    assert [first.headers["webhook-id"], second.headers["webhook-id"]] == expected   # in order
