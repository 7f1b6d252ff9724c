from __future__ import annotations

import logging
import random
import socket
from datetime import datetime, timedelta, timezone

import httpx
import pytest
from standardwebhooks import Webhook

from conveyor.core.webhooks.events import build_event
from conveyor.core.webhooks.signing import WebhookSecret, active_secrets, generate_secret
from conveyor.core.webhooks.ssrf import SsrfPolicy
from conveyor.worker.webhooks.backoff import MAX_ATTEMPTS
from conveyor.worker.webhooks.delivery import ERROR_TEXT_CHARS, RESPONSE_EXCERPT_BYTES, deliver
from conveyor.worker.webhooks.pinned import webhook_client
from tests.support.webhook_receiver import Receiver, Reply


def _event() -> dict[str, object]:
    return build_event("job.succeeded", {"id": "job_1", "status": "succeeded", "result": {"text": "hi"}},
                       datetime.now(timezone.utc))


def _now() -> datetime:
    return datetime.now(timezone.utc)


def test_delivery_is_signed_and_verified_by_the_independent_verifier(
        receiver: Receiver, loopback_client: httpx.Client, secret: str) -> None:
    event = _event()
    result = deliver(receiver.url, "msg_1", event, [secret], client=loopback_client, now=_now())
    assert (result.outcome, result.status_code, result.error, result.next_attempt_at) == ("delivered", 200,
                                                                                          None, None)
    assert result.response_excerpt == "ok"
    (request,) = receiver.received
    assert request.headers["content-type"] == "application/json"
    assert request.headers["webhook-id"] == "msg_1"
    assert Webhook(secret).verify(request.body, request.headers) == event
    assert secret not in str(result)


def test_retry_after_a_500_then_success_keeps_the_webhook_id(
        receiver: Receiver, loopback_client: httpx.Client, secret: str) -> None:
    receiver.replies = [Reply(500, body=b"boom")]
    event, rng = _event(), random.Random(0)
    first = deliver(receiver.url, "msg_2", event, [secret], client=loopback_client, now=_now(), rng=rng)
    assert (first.outcome, first.status_code, first.error, first.response_excerpt) == ("retry", 500,
                                                                                       "HTTP 500", "boom")
    assert first.next_attempt_at is not None
    assert timedelta(seconds=4) <= first.next_attempt_at - first.attempted_at <= timedelta(seconds=6)
    second = deliver(receiver.url, "msg_2", event, [secret], client=loopback_client, now=_now(),
                     attempt=2, rng=rng)
    assert second.outcome == "delivered"
    assert [r.headers["webhook-id"] for r in receiver.received] == ["msg_2", "msg_2"]
    assert receiver.received[0].body == receiver.received[1].body
    for request in receiver.received:
        Webhook(secret).verify(request.body, request.headers)


def test_429_honours_retry_after(receiver: Receiver, loopback_client: httpx.Client, secret: str) -> None:
    receiver.replies = [Reply(429, headers={"Retry-After": "600"})]
    now = _now()
    result = deliver(receiver.url, "msg_3", _event(), [secret], client=loopback_client, now=now,
                     rng=random.Random(0))
    assert result.outcome == "retry"
    assert result.next_attempt_at == now + timedelta(seconds=600)


def test_410_disables_the_subscription(
        receiver: Receiver, loopback_client: httpx.Client, secret: str) -> None:
    receiver.replies = [Reply(410)]
    result = deliver(receiver.url, "msg_4", _event(), [secret], client=loopback_client, now=_now())
    assert (result.outcome, result.status_code, result.next_attempt_at) == ("disabled", 410, None)


def test_other_4xx_fails_without_retry(
        receiver: Receiver, loopback_client: httpx.Client, secret: str) -> None:
    receiver.replies = [Reply(400, body=b"x" * (RESPONSE_EXCERPT_BYTES * 4))]
    result = deliver(receiver.url, "msg_5", _event(), [secret], client=loopback_client, now=_now())
    assert (result.outcome, result.status_code, result.next_attempt_at) == ("failed", 400, None)
    assert result.response_excerpt == "x" * RESPONSE_EXCERPT_BYTES


def test_timeout_is_retried(receiver: Receiver, loopback_client: httpx.Client, secret: str) -> None:
    receiver.replies = [Reply(200, delay_s=1.0)]
    result = deliver(receiver.url, "msg_6", _event(), [secret], client=loopback_client, now=_now(),
                     timeout_s=0.2)
    assert result.outcome == "retry"
    assert result.status_code is None
    assert result.error is not None and "timed out" in result.error
    assert result.next_attempt_at is not None


def test_connection_error_is_retried_with_truncated_error(loopback_client: httpx.Client, secret: str) -> None:
    with socket.socket() as probe:   # a port nobody listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = deliver(f"http://127.0.0.1:{port}/hooks", "msg_7", _event(), [secret], client=loopback_client,
                     now=_now())
    assert (result.outcome, result.status_code) == ("retry", None)
    assert result.error is not None and 0 < len(result.error) <= ERROR_TEXT_CHARS


def test_last_attempt_failing_exhausts_the_delivery(
        receiver: Receiver, loopback_client: httpx.Client, secret: str) -> None:
    receiver.replies = [Reply(503)]
    result = deliver(receiver.url, "msg_8", _event(), [secret], client=loopback_client, now=_now(),
                     attempt=MAX_ATTEMPTS)
    assert (result.outcome, result.next_attempt_at) == ("failed", None)
    assert result.error is not None and "exhausted" in result.error


def test_refused_target_fails_without_sending(receiver: Receiver, secret: str) -> None:
    with webhook_client(SsrfPolicy()) as client:
        result = deliver(receiver.url, "msg_9", _event(), [secret], client=client, now=_now())
    assert result.outcome == "failed"
    assert result.error is not None and "plain http" in result.error
    assert receiver.received == []


def test_signatures_verify_with_old_and_new_secret_during_rotation(
        receiver: Receiver, loopback_client: httpx.Client) -> None:
    now = _now()
    old = WebhookSecret(generate_secret(), expires_at=now + timedelta(days=1))
    new = WebhookSecret(generate_secret(24))
    secrets = active_secrets([old, new], now)
    result = deliver(receiver.url, "msg_10", _event(), secrets, client=loopback_client, now=now)
    assert result.outcome == "delivered"
    (request,) = receiver.received
    assert len(request.headers["webhook-signature"].split(" ")) == 2
    Webhook(old.value).verify(request.body, request.headers)
    Webhook(new.value).verify(request.body, request.headers)


def test_a_body_still_arriving_after_the_deadline_is_a_timeout(
        receiver: Receiver, loopback_client: httpx.Client, secret: str) -> None:
    ticks = iter([0.0, 100.0, 100.0, 100.0])   # injected clock: the body finishes long after the deadline
    result = deliver(receiver.url, "msg_11", _event(), [secret], client=loopback_client, now=_now(),
                     clock=lambda: next(ticks))
    assert (result.outcome, result.status_code) == ("retry", 200)
    assert result.error is not None and "timed out" in result.error


def test_secrets_and_query_tokens_never_reach_the_log(
        receiver: Receiver, loopback_client: httpx.Client, secret: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    deliver(receiver.url + "?token=receiver-token", "msg_12", _event(), [secret], client=loopback_client,
            now=_now())
    # NOTE: httpx's own INFO line shows the full URL: the service's logging keeps `httpx` at WARNING.
    ours = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("conveyor.worker.webhooks"))
    assert "msg_12" in ours
    assert secret not in caplog.text and secret not in ours and "receiver-token" not in ours


def test_a_payload_that_cannot_be_encoded_fails_without_sending(
        receiver: Receiver, loopback_client: httpx.Client, secret: str) -> None:
    event = build_event("job.succeeded", {"id": "job_1", "metadata": {"custom_id": "\udfff"}}, _now())
    result = deliver(receiver.url, "msg_13", event, [secret], client=loopback_client, now=_now())
    assert (result.outcome, result.status_code, result.next_attempt_at) == ("failed", None, None)
    assert result.error is not None and result.error.startswith("payload cannot be encoded as JSON: ")
    result.error.encode()   # storable: the lone surrogate is quoted as an escape
    assert receiver.received == []
