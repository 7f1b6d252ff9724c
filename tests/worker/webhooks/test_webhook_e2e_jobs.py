"""Job webhooks end to end on SQLite and Postgres: a job submitted over the API finishes in the store, the
sender delivers the event to a real loopback receiver, and the standardwebhooks package verifies it. Time is
injected into the sender's passes: retries are reached by moving `now`, never by sleeping."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from conveyor.core.clock import utcnow
from conveyor.core.store import jobs
from conveyor.core.webhooks.signing import verify
from tests.support.webhook_receiver import Receiver, Reply
from tests.support.webhook_service import WebhookService


def subscribe(client: TestClient, url: str, events: list[str] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"url": url} if events is None else {"url": url, "events": events}
    response = client.post("/v1/webhooks", json=body)
    assert response.status_code == 201, response.text
    return dict(response.json())


def deliveries(client: TestClient, job_id: str) -> list[dict[str, Any]]:
    response = client.get(f"/v1/jobs/{job_id}/deliveries")
    assert response.status_code == 200, response.text
    return list(response.json()["data"])


def test_job_succeeded_is_signed_and_carries_the_job_as_get_returns_it(
    webhook_service: WebhookService, receiver: Receiver,
) -> None:
    alice = webhook_service.client("alice")
    secret = subscribe(alice, receiver.url)["secret"]
    assert secret.startswith("whsec_")
    job_id = webhook_service.submit(alice, webhook=receiver.url + "?own=1")
    assert webhook_service.sender.tick(utcnow()) == 0   # nothing happens before the job ends
    webhook_service.succeed(job_id, utcnow())

    assert webhook_service.sender.tick(utcnow()) == 2   # the subscription and the job's own target
    assert sorted(r.path for r in receiver.received) == ["/hooks", "/hooks?own=1"]
    job = alice.get(f"/v1/jobs/{job_id}").json()
    for request in receiver.received:
        event = Webhook(secret).verify(request.body, request.headers)
        assert event["type"] == "job.succeeded"
        assert event["data"] == job
        assert json.loads(request.body)["data"]["result"]["text"] == "hi there"
    listed = deliveries(alice, job_id)
    assert {d["id"] for d in listed} == {r.headers["webhook-id"] for r in receiver.received}
    assert [(d["status"], [a["outcome"] for a in d["attempts"]]) for d in listed] == [
        ("delivered", ["delivered"]), ("delivered", ["delivered"])
    ]
    assert webhook_service.sender.tick(utcnow()) == 0   # delivered once, never again


def test_cancelled_and_expired_jobs_reach_a_filtered_subscription(
    webhook_service: WebhookService, receiver: Receiver,
) -> None:
    alice = webhook_service.client("alice")
    secret = subscribe(alice, receiver.url, ["job.cancelled", "job.expired"])["secret"]
    succeeded = webhook_service.submit(alice)
    cancelled = webhook_service.submit(alice)
    expiring = webhook_service.submit(alice, ttl=0.5)
    webhook_service.succeed(succeeded, utcnow())
    assert alice.post(f"/v1/jobs/{cancelled}/cancel").status_code == 200
    later = utcnow() + timedelta(seconds=2)
    with webhook_service.sessions() as session:
        assert jobs.expire_overdue(session, later) == [expiring]

    assert webhook_service.sender.tick(later) == 2
    events = [Webhook(secret).verify(r.body, r.headers) for r in receiver.received]
    assert sorted((e["type"], e["data"]["id"]) for e in events) == sorted(
        [("job.cancelled", cancelled), ("job.expired", expiring)]
    )
    for event in events:
        assert event["data"] == alice.get(f"/v1/jobs/{event['data']['id']}").json()
    assert deliveries(alice, succeeded) == []   # filtered out


def test_a_500_is_retried_with_the_same_webhook_id_on_the_backoff_schedule(
    webhook_service: WebhookService, receiver: Receiver,
) -> None:
    alice = webhook_service.client("alice")
    secret = subscribe(alice, receiver.url)["secret"]
    receiver.replies = [Reply(500), Reply(503, headers={"retry-after": "120"})]
    job_id = webhook_service.submit(alice)
    now = utcnow()
    webhook_service.succeed(job_id, now)

    assert webhook_service.sender.tick(now) == 1
    [delivery] = deliveries(alice, job_id)
    assert delivery["status"] == "pending"
    wait = _parse(delivery["next_attempt_at"]) - now
    assert timedelta(seconds=4.5) <= wait <= timedelta(seconds=5.5)   # 5 s, jittered by 10 %
    assert webhook_service.sender.tick(now + timedelta(seconds=4)) == 0   # not due yet

    second = now + timedelta(seconds=6)
    assert webhook_service.sender.tick(second) == 1   # 503, Retry-After 120 s < the 5 min step
    [delivery] = deliveries(alice, job_id)
    wait = _parse(delivery["next_attempt_at"]) - second
    assert timedelta(minutes=4.5) <= wait <= timedelta(minutes=5.5)   # the longer of schedule and header
    assert webhook_service.sender.tick(second + timedelta(minutes=6)) == 1

    [delivery] = deliveries(alice, job_id)
    assert delivery["status"] == "delivered"
    assert [(a["number"], a["outcome"], a["status_code"]) for a in delivery["attempts"]] == [
        (1, "retry", 500), (2, "retry", 503), (3, "delivered", 200)
    ]
    assert {r.headers["webhook-id"] for r in receiver.received} == {delivery["id"]}
    assert len({r.body for r in receiver.received}) == 1   # the event is frozen: same body every attempt
    Webhook(secret).verify(receiver.received[0].body, receiver.received[0].headers)
    for request in receiver.received[1:]:   # sent at injected times, beyond standardwebhooks' 5 min tolerance
        verify(request.body, request.headers, [secret], now=int(request.headers["webhook-timestamp"]))


def test_retry_after_longer_than_the_schedule_is_honoured(
    webhook_service: WebhookService, receiver: Receiver,
) -> None:
    alice = webhook_service.client("alice")
    subscribe(alice, receiver.url)
    receiver.replies = [Reply(429, headers={"retry-after": "120"})]
    job_id = webhook_service.submit(alice)
    now = utcnow()
    webhook_service.succeed(job_id, now)
    assert webhook_service.sender.tick(now) == 1
    [delivery] = deliveries(alice, job_id)
    assert _parse(delivery["next_attempt_at"]) - now == timedelta(seconds=120)
    assert webhook_service.sender.tick(now + timedelta(seconds=100)) == 0


def test_410_disables_the_subscription_until_it_is_enabled(
    webhook_service: WebhookService, receiver: Receiver,
) -> None:
    alice = webhook_service.client("alice")
    hook = subscribe(alice, receiver.url)
    receiver.replies = [Reply(410)]
    first = webhook_service.submit(alice)
    webhook_service.succeed(first, utcnow())
    assert webhook_service.sender.tick(utcnow()) == 1

    disabled = alice.get(f"/v1/webhooks/{hook['id']}").json()
    assert disabled["enabled"] is False
    assert "410" in disabled["disabled_reason"]
    [delivery] = deliveries(alice, first)
    assert delivery["status"] == "failed"
    assert [a["outcome"] for a in delivery["attempts"]] == ["disabled"]
    second = webhook_service.submit(alice)
    webhook_service.succeed(second, utcnow())
    assert deliveries(alice, second) == []   # no events for a disabled subscription

    enabled = alice.post(f"/v1/webhooks/{hook['id']}/enable")
    assert enabled.status_code == 200 and enabled.json()["enabled"] is True
    third = webhook_service.submit(alice)
    webhook_service.succeed(third, utcnow())
    assert webhook_service.sender.tick(utcnow()) == 1
    assert deliveries(alice, third)[0]["status"] == "delivered"


def test_signatures_verify_with_old_and_new_secret_during_rotation_then_only_new(
    webhook_service: WebhookService, receiver: Receiver,
) -> None:
    alice = webhook_service.client("alice")
    old = subscribe(alice, receiver.url)["secret"]
    rotated = alice.post("/v1/webhooks/secret/rotate")
    assert rotated.status_code == 200
    new = rotated.json()["secret"]
    assert new.startswith("whsec_") and new != old
    window = timedelta(seconds=webhook_service.settings.webhook_rotation_window_s)
    assert _parse(rotated.json()["previous_valid_until"]) - utcnow() <= window

    during = webhook_service.submit(alice)
    webhook_service.succeed(during, utcnow())
    assert webhook_service.sender.tick(utcnow()) == 1
    request = receiver.received[-1]
    assert len(request.headers["webhook-signature"].split()) == 2
    Webhook(old).verify(request.body, request.headers)
    Webhook(new).verify(request.body, request.headers)

    with webhook_service.sessions() as session:   # close the window: the old secret expires now
        close = "UPDATE webhook_secrets SET expires_at = created_at WHERE expires_at IS NOT NULL"
        session.execute(text(close))
        session.commit()
    after = webhook_service.submit(alice)
    webhook_service.succeed(after, utcnow())
    assert webhook_service.sender.tick(utcnow()) == 1
    request = receiver.received[-1]
    Webhook(new).verify(request.body, request.headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(old).verify(request.body, request.headers)


def test_resend_sends_the_same_event_again_with_the_same_webhook_id(
    webhook_service: WebhookService, receiver: Receiver,
) -> None:
    alice = webhook_service.client("alice")
    secret = subscribe(alice, receiver.url)["secret"]
    job_id = webhook_service.submit(alice)
    webhook_service.succeed(job_id, utcnow())
    assert webhook_service.sender.tick(utcnow()) == 1
    [delivery] = deliveries(alice, job_id)

    resent = alice.post(f"/v1/webhooks/deliveries/{delivery['id']}/resend")
    assert resent.status_code == 202 and resent.json()["status"] == "pending"
    assert webhook_service.sender.tick(utcnow()) == 1
    first, second = receiver.received
    assert first.headers["webhook-id"] == second.headers["webhook-id"] == delivery["id"]
    assert Webhook(secret).verify(second.body, second.headers) == json.loads(first.body)
    [delivery] = deliveries(alice, job_id)
    assert [(a["number"], a["outcome"]) for a in delivery["attempts"]] == [(1, "delivered"), (2, "delivered")]


def test_a_job_with_only_its_own_webhook_is_signed_with_the_tenant_secret(
    webhook_service: WebhookService, receiver: Receiver,
) -> None:
    alice = webhook_service.client("alice")
    job_id = webhook_service.submit(alice, webhook={"url": receiver.url})
    webhook_service.succeed(job_id, utcnow())
    assert webhook_service.sender.tick(utcnow()) == 1   # the tenant's secret is made for this first send
    secret = alice.post("/v1/webhooks/secret/rotate").json()["secret"]
    [delivery] = deliveries(alice, job_id)
    assert delivery["subscription_id"] is None
    alice.post(f"/v1/webhooks/deliveries/{delivery['id']}/resend")
    assert webhook_service.sender.tick(utcnow()) == 1
    Webhook(secret).verify(receiver.received[-1].body, receiver.received[-1].headers)


def _parse(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))
