"""The webhook API on SQLite and Postgres: SSRF refusals where a target is given, subscription management,
tenant isolation, one sender per attempt, and batch events through `enqueue_batch_event`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import text
from standardwebhooks import Webhook

from conveyor.core.clock import utcnow
from conveyor.core.store import batches, webhooks
from conveyor.core.store.webhook_events import enqueue_batch_event
from tests.support.webhook_receiver import Receiver
from tests.support.webhook_service import WebhookService

REFUSED = [
    ("http://10.1.2.3/hook", "plain http"),
    ("https://10.1.2.3/hook", "private"),
    ("https://192.168.0.7/hook", "private"),
    ("https://169.254.169.254/latest/meta-data", "metadata"),
    ("https://metadata.google.internal/x", "metadata"),
    ("http://[::1]:8080/hook", "plain http"),
    ("https://[::1]:8080/hook", "loopback"),
    ("ftp://example.com/hook", "scheme"),
    ("http://unresolvable.invalid/hook", "does not resolve"),   # http, so DNS must approve it
]


@pytest.mark.parametrize(("url", "reason"), REFUSED)
def test_refused_targets_are_422_naming_the_field(webhook_service: WebhookService, url: str,
                                                  reason: str) -> None:
    alice = webhook_service.client("alice")
    created = alice.post("/v1/webhooks", json={"url": url})
    assert created.status_code == 422, created.text
    assert created.json()["error"]["field"] == "url"
    assert created.json()["error"]["code"] == "webhook_target_refused"
    assert reason in created.json()["error"]["message"]
    submitted = alice.post("/v1/jobs", json={"prompt": "hi", "webhook": url})
    assert submitted.status_code == 422, submitted.text
    assert submitted.json()["error"]["field"] == "webhook"
    batch = alice.post("/v1/batches", json={"input": "s3://conveyor-batches/a.jsonl", "output": "s3://conveyor-batches/out/",
                                             "webhook": {"url": url}})
    assert batch.status_code == 422, batch.text  # refused at creation, as a job's target is
    assert batch.json()["error"]["field"] == "webhook"
    assert alice.get("/v1/webhooks").json()["data"] == []
    assert alice.get("/v1/jobs").json()["data"] == []
    assert alice.get("/v1/batches").json()["data"] == []


def test_allowlisted_loopback_and_unresolved_https_names_are_accepted(
    webhook_service: WebhookService, receiver: Receiver,
) -> None:
    alice = webhook_service.client("alice")
    assert alice.post("/v1/webhooks", json={"url": receiver.url}).status_code == 201
    # DNS may be set up later; every delivery runs the full guard again before connecting.
    assert alice.post("/v1/webhooks", json={"url": "https://hooks.unresolvable.invalid/x"}).status_code == 201
    assert alice.post("/v1/jobs", json={"prompt": "hi", "webhook": {"url": receiver.url}}).status_code == 202


def test_bad_event_filters_are_422(webhook_service: WebhookService, receiver: Receiver) -> None:
    alice = webhook_service.client("alice")
    response = alice.post("/v1/webhooks", json={"url": receiver.url, "events": ["job.exploded"]})
    assert response.status_code == 422
    assert response.json()["error"]["field"] == "events"


def test_subscriptions_list_get_delete_and_the_secret_is_shown_once(
    webhook_service: WebhookService, receiver: Receiver,
) -> None:
    alice = webhook_service.client("alice")
    first = alice.post("/v1/webhooks", json={"url": receiver.url, "events": ["job.*"], "description": "a"})
    second = alice.post("/v1/webhooks", json={"url": receiver.url + "/2"})
    assert first.json()["secret"].startswith("whsec_")
    assert second.json()["secret"] is None
    listed = alice.get("/v1/webhooks").json()["data"]
    assert [h["id"] for h in listed] == [first.json()["id"], second.json()["id"]]
    assert all("secret" not in h for h in listed)
    assert listed[0]["events"] == ["job.*"] and listed[1]["events"] == ["*"]
    assert alice.delete(f"/v1/webhooks/{first.json()['id']}").status_code == 204
    assert alice.get(f"/v1/webhooks/{first.json()['id']}").status_code == 404
    assert [h["id"] for h in alice.get("/v1/webhooks").json()["data"]] == [second.json()["id"]]


def test_tenants_are_isolated(webhook_service: WebhookService, receiver: Receiver) -> None:
    alice, bob = webhook_service.client("alice"), webhook_service.client("bob")
    hook = alice.post("/v1/webhooks", json={"url": receiver.url}).json()
    bob_secret = bob.post("/v1/webhooks", json={"url": receiver.url + "?bob"}).json()["secret"]
    job_id = webhook_service.submit(alice)
    webhook_service.succeed(job_id, utcnow())
    assert webhook_service.sender.tick(utcnow()) == 1
    assert [r.path for r in receiver.received] == ["/hooks"]   # bob's subscription hears nothing of alice
    [delivery] = alice.get(f"/v1/jobs/{job_id}/deliveries").json()["data"]

    for method, path in [("GET", f"/v1/webhooks/{hook['id']}"), ("DELETE", f"/v1/webhooks/{hook['id']}"),
                         ("POST", f"/v1/webhooks/{hook['id']}/enable"),
                         ("GET", f"/v1/jobs/{job_id}/deliveries"),
                         ("POST", f"/v1/webhooks/deliveries/{delivery['id']}/resend")]:
        response = bob.request(method, path)
        assert response.status_code == 404, (method, path, response.text)
        assert response.json()["error"]["code"] == "not_found"
    assert [h["url"] for h in bob.get("/v1/webhooks").json()["data"]] == [receiver.url + "?bob"]
    assert alice.get(f"/v1/webhooks/{hook['id']}").status_code == 200
    with pytest.raises(Exception, match="signature"):   # each tenant signs with its own secret
        Webhook(bob_secret).verify(receiver.received[0].body, receiver.received[0].headers)


def test_an_attempt_is_claimed_by_one_sender_only(
    webhook_service: WebhookService, receiver: Receiver,
) -> None:
    alice = webhook_service.client("alice")
    alice.post("/v1/webhooks", json={"url": receiver.url})
    job_id = webhook_service.submit(alice)
    now = utcnow()
    webhook_service.succeed(job_id, now)
    with webhook_service.sessions() as one, webhook_service.sessions() as two:
        [(delivery_id, attempts, url)] = webhooks.due(one, now, 10)
        assert webhooks.due(two, now, 10) == [(delivery_id, attempts, url)] and url == receiver.url
        lease = now.replace(year=now.year + 1)
        assert webhooks.claim(one, delivery_id, attempts, now, lease) is not None
        assert webhooks.claim(two, delivery_id, attempts, now, lease) is None
        assert webhooks.due(two, now, 10) == []   # leased until a dead sender's attempt may be retried
    assert webhook_service.sender.tick(now) == 0
    assert receiver.received == []


@pytest.fixture
def batch_id(webhook_service: WebhookService) -> Iterator[str]:
    """A batch row of alice's (removed afterwards, so no batch runner of a later test picks it up)."""
    with webhook_service.sessions() as session:
        row = batches.create(session, tenant_id="alice", input_url="s3://in/x.jsonl", output_url="s3://out/",
                             queue="documents", now=utcnow())
    yield row.id
    with webhook_service.sessions() as session:
        session.execute(text("DELETE FROM batches WHERE id = :id"), {"id": row.id})
        session.commit()


def test_batch_events_reach_subscriptions_and_the_batch_webhook(
    webhook_service: WebhookService, receiver: Receiver, batch_id: str,
) -> None:
    alice = webhook_service.client("alice")
    secret = alice.post("/v1/webhooks", json={"url": receiver.url, "events": ["batch.*"]}).json()["secret"]
    now = utcnow()
    batch: dict[str, Any] = {"id": batch_id, "status": "completed", "request_counts": {"total": 3}}
    with webhook_service.sessions() as session:
        enqueue_batch_event(session, batch, "batch.completed", "alice", {"url": receiver.url + "?batch"}, now)
        session.commit()
    job_id = webhook_service.submit(alice)
    webhook_service.succeed(job_id, now)   # filtered out: the subscription wants batch events only

    assert webhook_service.sender.tick(utcnow()) == 2
    for request in receiver.received:
        assert Webhook(secret).verify(request.body, request.headers) == {
            "type": "batch.completed", "timestamp": now.isoformat().replace("+00:00", "Z"), "data": batch,
        }
    listed = alice.get(f"/v1/batches/{batch_id}/deliveries")
    assert listed.status_code == 200, listed.text
    assert sorted((d["status"], d["subscription_id"] is None) for d in listed.json()["data"]) == [
        ("delivered", False), ("delivered", True)
    ]
    assert {d["id"] for d in listed.json()["data"]} == {r.headers["webhook-id"] for r in receiver.received}
    assert webhook_service.client("bob").get(f"/v1/batches/{batch_id}/deliveries").status_code == 404
