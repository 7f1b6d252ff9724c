"""Quotas per tenant over HTTP (SQLite and PostgreSQL): a tenant over its max_queued or its tokens per minute
gets 429 with Retry-After while another tenant at the same moment gets 202; overrides per tenant beat the
defaults; and /v1/queues shows each caller its own counts and quota use, the totals only to an admin key."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from conveyor.core.clock import utcnow
from conveyor.core.store import jobs, keys, tenants
from tests.support.service import Service, error_of


def _post(client: TestClient, **body: object) -> httpx.Response:
    return client.post("/v1/jobs", json={"prompt": "hello there", "max_tokens": 4, **body})


def test_a_tenant_at_its_max_queued_gets_429_while_another_gets_202(
    make_service: Callable[..., Service],
) -> None:
    service = make_service(tenant_max_queued=2)
    alice, bob = service.client("alice"), service.client("bob")
    assert [_post(alice).status_code for _ in range(2)] == [202, 202]

    refused, accepted = _post(alice), _post(bob)

    assert refused.status_code == 429 and accepted.status_code == 202
    assert int(refused.headers["Retry-After"]) >= 1
    error = error_of(refused)
    assert error["code"] == "tenant_queue_full" and error["field"] == "queue"


def test_a_tenants_own_max_queued_overrides_the_default(
    make_service: Callable[..., Service], session: Session,
) -> None:
    service = make_service()
    alice, bob = service.client("alice"), service.client("bob")
    tenants.set_overrides(session, "alice", {"max_queued": 1}, utcnow())
    assert _post(alice).status_code == 202
    assert _post(alice).status_code == 429
    assert [_post(bob).status_code for _ in range(3)] == [202] * 3
    tenants.set_overrides(session, "alice", {"max_queued": None}, utcnow())  # back to the default
    assert _post(alice).status_code == 202


def test_tokens_per_minute_count_prompt_and_max_tokens_and_refuse_with_retry_after(
    make_service: Callable[..., Service], session: Session,
) -> None:
    service = make_service(tenant_tokens_per_minute=60)
    alice, bob = service.client("alice"), service.client("bob")
    first = _post(alice, max_tokens=20)
    assert first.status_code == 202
    reserved = first.json()["usage"]["prompt_tokens"] + 20
    assert _post(alice, max_tokens=20).status_code == 202

    refused, accepted = _post(alice, max_tokens=20), _post(bob, max_tokens=20)

    assert refused.status_code == 429 and accepted.status_code == 202
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    assert error_of(refused)["code"] == "tokens_per_minute_exceeded"
    queues = alice.get("/v1/queues").json()
    assert queues["tokens_per_minute"] == 60 and queues["tokens_used_last_minute"] == 2 * reserved
    # A job that finished counts what it used: the reservation is corrected, and room comes back.
    job_id = first.json()["id"]
    assert jobs.claim(session, job_id, "w1", utcnow()) is not None
    assert jobs.complete(session, job_id, 1, result_text="x", finish_reason="stop", prompt_tokens=1,
                         completion_tokens=1, preemptions=0, first_token_at=None, now=utcnow())
    assert alice.get("/v1/queues").json()["tokens_used_last_minute"] == reserved + 2
    assert _post(alice, max_tokens=20).status_code == 202


def test_a_job_larger_than_the_tokens_per_minute_is_a_422_naming_max_tokens(
    make_service: Callable[..., Service],
) -> None:
    service = make_service(tenant_tokens_per_minute=10)
    response = _post(service.client("alice"), max_tokens=64)
    assert response.status_code == 422
    error = error_of(response)
    assert error["code"] == "tokens_per_minute_exceeded" and error["field"] == "max_tokens"


def test_queues_show_the_callers_own_counts_and_the_totals_only_to_an_admin_key(
    make_service: Callable[..., Service], session: Session,
) -> None:
    service = make_service(tenant_max_running=3)
    alice, bob = service.client("alice"), service.client("bob")
    tenants.set_overrides(session, "bob", {"weight": 2.0, "max_queued": 7}, utcnow())
    for _ in range(3):
        _post(alice)
    _post(bob, queue="documents")
    with service.session_factory() as s:
        _, admin_key = keys.create_key(s, "ops", utcnow(), admin=True)
    admin = service.client_with_key(admin_key)

    mine = alice.get("/v1/queues").json()
    theirs = bob.get("/v1/queues").json()
    every = admin.get("/v1/queues").json()

    def counts(body: dict[str, Any]) -> dict[str, int]:
        return {q["name"]: q["queued"] for q in body["data"]}

    assert (mine["scope"], mine["tenant"]) == ("tenant", "alice")
    assert counts(mine) == {"interactive": 3, "documents": 0}
    assert counts(theirs) == {"interactive": 0, "documents": 1}
    assert (every["scope"], counts(every)) == ("all", {"interactive": 3, "documents": 1})
    assert theirs["data"][0]["tenant_limits"] == {"weight": 2.0, "max_queued": 7, "max_running": 3}
    assert mine["data"][0]["tenant_limits"] == {"weight": 1.0, "max_queued": None, "max_running": 3}
    assert mine["data"][0]["limits"]["max_queued"] == service.settings.queues["interactive"].max_queued


def test_a_retry_is_admitted_as_a_submission_is(make_service: Callable[..., Service]) -> None:
    service = make_service(tenant_max_queued=1)
    alice = service.client("alice")
    first = _post(alice).json()
    assert alice.post(f"/v1/jobs/{first['id']}/cancel").json()["status"] == "cancelled"
    assert _post(alice).status_code == 202  # alice is at her limit again

    refused = alice.post(f"/v1/jobs/{first['id']}/retry")
    assert refused.status_code == 429 and error_of(refused)["code"] == "tenant_queue_full", refused.text
    assert alice.get(f"/v1/jobs/{first['id']}").json()["status"] == "cancelled"  # untouched


def test_a_tenant_may_schedule_no_more_jobs_than_it_may_queue(make_service: Callable[..., Service]) -> None:
    service = make_service(tenant_max_queued=2)
    alice, bob = service.client("alice"), service.client("bob")
    assert [_post(alice, delay_s=600).status_code for _ in range(2)] == [202, 202]
    refused = _post(alice, delay_s=600)
    assert refused.status_code == 429 and error_of(refused)["field"] == "run_at", refused.text
    assert error_of(refused)["code"] == "tenant_schedule_full"
    assert _post(alice).status_code == 202  # scheduled jobs are not in her queue's depth
    assert _post(bob, delay_s=600).status_code == 202
