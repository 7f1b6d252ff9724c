"""The job lifecycle over HTTP, with the store playing the worker's part (claim, first token, complete)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session
from transformers import AutoTokenizer

from conveyor.core.clock import utcnow
from conveyor.core.store import jobs, keys, workers
from tests.support.live_server import wait_for
from tests.support.service import RecordingPublisher, Service, error_of


def test_submit_run_complete_read_back(
    service: Service, alice: TestClient, session: Session, demo_model_dir: Path
) -> None:
    body = {
        "prompt": "Good morning!",
        "max_tokens": 8,
        "temperature": 0,
        "metadata": {"doc": [1, "a"]},
        "webhook": "https://example.com/hook",
        "timeout": 30,
    }
    r = alice.post("/v1/jobs", json=body)
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["status"] == "queued" and job["queue"] == "interactive" and job["attempts"] == 0
    assert job["metadata"] == {"doc": [1, "a"]} and job["result"] is None and job["error"] is None
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    assert job["usage"]["prompt_tokens"] == len(tokenizer.encode("Good morning!")) > 3
    service.wait_dispatched(job["id"])  # the relay publishes from its own thread, then marks the row
    assert service.publisher.published == [(job["id"], "demo-model:interactive")]

    row = jobs.get(session, job["id"])
    assert row is not None and row.dispatched_at is not None and row.timeout_s == 30
    assert row.params["max_tokens"] == 8 and row.params["temperature"] == 0 and row.params["stop"] == []
    assert row.webhook == {"url": "https://example.com/hook"}
    start = row.created_at + timedelta(seconds=1)
    assert jobs.claim(session, job["id"], "w1", start) is not None
    assert alice.get(f"/v1/jobs/{job['id']}").json()["status"] == "running"
    assert jobs.record_first_token(session, job["id"], 1, start + timedelta(seconds=0.5))
    assert jobs.complete(
        session,
        job["id"],
        1,
        result_text="hi there",
        finish_reason="length",
        prompt_tokens=5,
        completion_tokens=8,
        preemptions=2,
        first_token_at=None,
        now=start + timedelta(seconds=2),
    )

    done = alice.get(f"/v1/jobs/{job['id']}").json()
    assert done["status"] == "succeeded"
    assert done["result"] == {"text": "hi there", "finish_reason": "length", "logprobs": None,
                              "tool_calls": None, "choices": None, "prompt_logprobs": None}
    assert done["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "cached_tokens": 0,
                             "draft_tokens": 0, "accepted_draft_tokens": 0}
    assert (done["queue_time_s"], done["time_to_first_token_s"], done["end_to_end_s"]) == (1.0, 1.5, 3.0)
    assert done["attempts"] == 1 and done["preemptions"] == 2 and done["metadata"] == {"doc": [1, "a"]}


def test_messages_are_counted_with_the_chat_template(alice: TestClient, demo_model_dir: Path) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    r = alice.post("/v1/jobs", json={"messages": messages, "queue": "documents"})
    assert r.status_code == 202, r.text
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(text, add_special_tokens=False))
    assert r.json()["queue"] == "documents"


def test_cancel_queued_job(alice: TestClient, session: Session) -> None:
    job = alice.post("/v1/jobs", json={"prompt": "x"}).json()
    r = alice.post(f"/v1/jobs/{job['id']}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    assert r.json()["error"]["code"] == "cancelled" and r.json()["finished_at"] is not None
    assert jobs.claim(session, job["id"], "w1", utcnow()) is None  # the broker message arrives late
    assert alice.get(f"/v1/jobs/{job['id']}").json()["status"] == "cancelled"
    again = alice.post(f"/v1/jobs/{job['id']}/cancel")
    assert again.status_code == 200 and again.json()["status"] == "cancelled"


def test_cancel_running_job_flips_the_row(alice: TestClient, session: Session) -> None:
    job = alice.post("/v1/jobs", json={"prompt": "x"}).json()
    assert jobs.claim(session, job["id"], "w1", utcnow()) is not None
    assert alice.post(f"/v1/jobs/{job['id']}/cancel").json()["status"] == "cancelled"
    assert jobs.attempt_states(session, [job["id"]])[job["id"]].status == "cancelled"
    assert not jobs.complete(
        session,
        job["id"],
        1,
        result_text="late",
        finish_reason="stop",
        prompt_tokens=1,
        completion_tokens=1,
        preemptions=0,
        first_token_at=None,
        now=utcnow(),
    )


def test_cancel_finished_job_is_409(alice: TestClient, session: Session) -> None:
    job = alice.post("/v1/jobs", json={"prompt": "x"}).json()
    assert jobs.claim(session, job["id"], "w1", utcnow()) is not None
    assert jobs.fail(session, job["id"], 1, code="timeout", message="over 1 s", now=utcnow())
    r = alice.post(f"/v1/jobs/{job['id']}/cancel")
    assert r.status_code == 409
    assert error_of(r) == {
        "code": "not_cancellable",
        "message": f"id: job {job['id']} already failed",
        "field": "id",
    }
    failed = alice.get(f"/v1/jobs/{job['id']}").json()
    assert failed["error"] == {"code": "timeout", "message": "over 1 s"}


def test_ttl_expiry(alice: TestClient, session: Session) -> None:
    by_reconciler = alice.post("/v1/jobs", json={"prompt": "x", "ttl": 5}).json()
    by_claim = alice.post("/v1/jobs", json={"prompt": "y", "ttl": 5}).json()
    assert by_reconciler["expires_at"] is not None
    # The API's dispatch relay marks the new jobs dispatched, holding their rows meanwhile; the expiry sweep
    # passes over rows another transaction holds (SKIP LOCKED), so it runs once the relay is done with them.
    wait_for(lambda: all(jobs.get(session, job["id"]).dispatched_at is not None  # type: ignore[union-attr]
                         for job in (by_reconciler, by_claim)), "the relay to mark both jobs dispatched")
    later = utcnow() + timedelta(seconds=6)
    assert jobs.claim(session, by_claim["id"], "w1", later) is None
    assert jobs.expire_overdue(session, later) == [by_reconciler["id"]]
    for job in (by_reconciler, by_claim):
        got = alice.get(f"/v1/jobs/{job['id']}").json()
        assert got["status"] == "expired" and got["error"]["code"] == "expired" and got["started_at"] is None


def test_queue_deadline_is_the_default_ttl(make_service, session: Session) -> None:  # type: ignore[no-untyped-def]
    svc = make_service(queues={"documents": {"default_ttl_s": 7}})
    client = svc.client("alice")
    job = client.post("/v1/jobs", json={"prompt": "x", "queue": "documents"}).json()
    row = jobs.get(session, job["id"])
    assert row is not None and row.ttl_s == 7
    explicit = client.post("/v1/jobs", json={"prompt": "x", "queue": "documents", "ttl": 100}).json()
    assert jobs.get(session, explicit["id"]).ttl_s == 100  # type: ignore[union-attr]


def test_other_tenants_jobs_are_404(service: Service, alice: TestClient) -> None:
    bob = service.client("bob")
    job = alice.post("/v1/jobs", json={"prompt": "secret"}).json()
    for r in (bob.get(f"/v1/jobs/{job['id']}"), bob.post(f"/v1/jobs/{job['id']}/cancel")):
        assert r.status_code == 404
        assert error_of(r) == {
            "code": "not_found",
            "message": f"id: job {job['id']} not found",
            "field": "id",
        }
    assert bob.get("/v1/jobs").json()["data"] == []
    assert alice.get(f"/v1/jobs/{job['id']}").json()["status"] == "queued"


def test_unknown_job_is_404(alice: TestClient) -> None:
    r = alice.get("/v1/jobs/job_nope")
    assert r.status_code == 404 and error_of(r)["code"] == "not_found"


def test_idempotent_resubmission(service: Service, alice: TestClient) -> None:
    body = {"prompt": "once", "max_tokens": 4}
    first = alice.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k-1"})
    again = alice.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k-1"})
    assert first.status_code == 202 and again.status_code == 200
    assert again.json() == first.json()
    assert len(service.publisher.published) == 1
    other = alice.post("/v1/jobs", json={**body, "max_tokens": 5}, headers={"Idempotency-Key": "k-1"})
    assert other.status_code == 409
    original = first.json()["id"]
    assert error_of(other) == {
        "code": "idempotency_conflict",
        "field": "Idempotency-Key",
        "message": f"Idempotency-Key: already used for job {original} with a different request body",
    }
    # Keys are per tenant: bob's "k-1" is a new job.
    bob = service.client("bob")
    theirs = bob.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k-1"})
    assert theirs.status_code == 202 and theirs.json()["id"] != first.json()["id"]


def test_pagination_and_filters(service: Service, alice: TestClient, session: Session) -> None:
    ids = [alice.post("/v1/jobs", json={"prompt": f"p{i}"}).json()["id"] for i in range(5)]
    doc = alice.post("/v1/jobs", json={"prompt": "d", "queue": "documents"}).json()["id"]
    assert jobs.claim(session, ids[0], "w1", utcnow()) is not None
    seen: list[str] = []
    cursor = None
    while True:
        params: dict[str, str | int] = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = alice.get("/v1/jobs", params=params).json()
        assert len(page["data"]) <= 2
        seen += [j["id"] for j in page["data"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert sorted(seen) == sorted([*ids, doc]) and len(seen) == 6
    created = [j["created_at"] for j in alice.get("/v1/jobs", params={"limit": 100}).json()["data"]]
    assert created == sorted(created, reverse=True)
    queued_interactive = alice.get("/v1/jobs", params={"status": "queued", "queue": "interactive"}).json()
    assert {j["id"] for j in queued_interactive["data"]} == set(ids[1:])
    running = alice.get("/v1/jobs", params={"status": "running"}).json()
    assert [j["id"] for j in running["data"]] == [ids[0]]


def test_list_rejects_bad_filters(alice: TestClient) -> None:
    cases = [
        ({"status": "done"}, "status"),
        ({"queue": "gpu"}, "queue"),
        ({"cursor": "garbage!"}, "cursor"),
        ({"limit": 0}, "limit"),
        ({"limit": 101}, "limit"),
    ]
    for params, field in cases:
        r = alice.get("/v1/jobs", params=params)
        assert r.status_code == 422, (params, r.text)
        assert error_of(r)["field"] == field and error_of(r)["message"].startswith(f"{field}:")


def test_queues_report_depth_running_limits_age_and_live_workers(
    service: Service, alice: TestClient, session: Session
) -> None:
    a = alice.post("/v1/jobs", json={"prompt": "a"}).json()["id"]
    alice.post("/v1/jobs", json={"prompt": "b"})
    assert jobs.claim(session, a, "w1", utcnow()) is not None
    # Live: one worker on interactive. Not live: one silent past dead_after, one stopped.
    workers.register(session, "w1", hostname="h", pid=1, queues=["demo-model:interactive"], now=utcnow())
    silent = utcnow() - timedelta(seconds=service.settings.worker_dead_after_s + 1)
    workers.register(session, "w-silent", hostname="h", pid=2, queues=[
        "demo-model:interactive", "demo-model:documents"],
                     now=silent)
    workers.register(session, "w-gone", hostname="h", pid=3, queues=["demo-model:documents"], now=utcnow())
    workers.mark_stopped(session, "w-gone", utcnow())
    queues = {q["name"]: q for q in alice.get("/v1/queues").json()["data"]}
    assert set(queues) == {"interactive", "documents"}
    interactive = queues["interactive"]
    assert (interactive["queued"], interactive["running"], interactive["workers"]) == (1, 1, 1)
    assert interactive["oldest_queued_age_s"] >= 0
    assert queues["documents"] == {
        "name": "documents",
        "model": "demo-model",
        "queued": 0,
        "running": 0,
        "scheduled": 0,
        "oldest_queued_age_s": None,
        "workers": 0,
        # Clamped to what the demo model (1024 positions) can run: see tests/api/test_context_limit_http.py.
        "limits": {**service.settings.queues["documents"].model_dump(), "max_prompt_tokens": 1023,
                   "max_output_tokens": 1023},
        "tenant_limits": {"weight": 1.0, "max_queued": None, "max_running": None},
        "deadlines_last_hour": {"on_time": 0, "late": 0, "missed": 0},
        "deadlines_last_hour_by_tier": {},
    }


def test_publish_failure_leaves_job_undispatched(make_service, session: Session) -> None:  # type: ignore[no-untyped-def]

    svc = make_service(publisher=RecordingPublisher(reachable=False))
    r = svc.client("alice").post("/v1/jobs", json={"prompt": "x"})
    assert r.status_code == 202  # accepted: the job is in the store, the reconciler will publish it
    row = jobs.get(session, r.json()["id"])
    assert row is not None and row.dispatched_at is None
    assert jobs.undispatched(session, utcnow() + timedelta(seconds=1)) == [(row.id, "demo-model:interactive")]


def test_idempotency_race_returns_the_winner(
    service: Service, alice: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two submissions with one key both miss the lookup; the loser's insert fails and replays the winner."""
    body = {"prompt": "race"}
    winner = alice.post("/v1/jobs", json=body, headers={"Idempotency-Key": "race"}).json()
    real_lookup = jobs.by_idempotency_key
    calls: list[str] = []

    def lookup_misses_once(session: Session, tenant_id: str, key: str) -> jobs.Job | None:
        calls.append(key)
        return None if len(calls) == 1 else real_lookup(session, tenant_id, key)

    monkeypatch.setattr(jobs, "by_idempotency_key", lookup_misses_once)
    loser = alice.post("/v1/jobs", json=body, headers={"Idempotency-Key": "race"})
    assert loser.status_code == 200 and loser.json()["id"] == winner["id"] and len(calls) == 2
    conflict = alice.post("/v1/jobs", json={"prompt": "other"}, headers={"Idempotency-Key": "race"})
    assert conflict.status_code == 409
    assert len(service.publisher.published) == 1


def test_priority_and_deadline_are_stored_and_shown(alice: TestClient, session: Session) -> None:
    job = alice.post("/v1/jobs", json={"prompt": "hi", "priority": -2, "deadline_s": 30}).json()
    assert job["priority"] == -2 and job["service_tier"] is None
    deadline = datetime.fromisoformat(job["deadline_at"]) - datetime.fromisoformat(job["created_at"])
    assert deadline == timedelta(seconds=30)
    assert job["start_by"] == job["deadline_at"]  # no worker has published its pace: no run time known
    plain = alice.post("/v1/jobs", json={"prompt": "hi"}).json()
    assert (plain["priority"], plain["deadline_at"], plain["start_by"]) == (0, None, None)
    flex = alice.post("/v1/jobs", json={"prompt": "hi", "service_tier": "flex"}).json()
    assert (flex["priority"], flex["service_tier"]) == (1, "flex")


def test_a_job_starts_by_its_deadline_less_its_run_time_at_the_workers_pace(
    make_service: Callable[..., Service], session: Session,
) -> None:
    # The worker stays alive however slowly the POST comes (a loaded machine took over the 2 s default).
    alice = make_service(worker_dead_after_s=600).client("alice")
    workers.register(session, "w1", hostname="h", pid=1, queues=["demo-model:interactive"], now=utcnow())
    workers.heartbeat(session, "w1", utcnow(), {"step_s": 0.25, "prefill_token_s": 0.0})
    job = alice.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 40, "deadline_s": 30}).json()
    slack = datetime.fromisoformat(job["start_by"]) - datetime.fromisoformat(job["created_at"])
    assert slack == timedelta(seconds=30 - 40 * 0.25)


def test_queues_show_the_callers_deadline_outcomes_of_the_last_hour(
    service: Service, alice: TestClient, session: Session
) -> None:
    bob = service.client("bob")
    # Deadlines far enough ahead that a loaded machine's submits cannot miss the first one (2 s did, in CI).
    ids = [alice.post("/v1/jobs", json={"prompt": "hi", "deadline_s": 120}).json()["id"] for _ in range(3)]
    bob.post("/v1/jobs", json={"prompt": "hi", "deadline_s": 120})  # another tenant's: not counted for alice
    alice.post("/v1/jobs", json={"prompt": "hi"})  # no deadline: not counted
    start = utcnow()
    done = dict(result_text="x", finish_reason="stop", prompt_tokens=1, completion_tokens=1, preemptions=0,
                first_token_at=None)
    for job_id, finished in zip(ids[:2], (start, start + timedelta(seconds=300)), strict=True):
        assert jobs.claim(session, job_id, "w1", start) is not None
        assert jobs.complete(session, job_id, 1, now=finished, **done)
    assert alice.post(f"/v1/jobs/{ids[2]}/cancel").status_code == 200
    queues = {q["name"]: q for q in alice.get("/v1/queues").json()["data"]}
    assert queues["interactive"]["deadlines_last_hour"] == {"on_time": 1, "late": 1, "missed": 1}
    assert queues["interactive"]["deadlines_last_hour_by_tier"] == {"default": {"on_time": 1, "late": 1,
                                                                                "missed": 1}}


def test_queues_show_goodput_per_tier_and_an_admin_may_list_one_tenant(
    service: Service, alice: TestClient, session: Session
) -> None:
    bob = service.client("bob")
    with service.session_factory() as s:
        _, admin_key = keys.create_key(s, "ops", utcnow(), admin=True)
    admin = service.client_with_key(admin_key)

    def submit(client: TestClient, **body: Any) -> str:
        response = client.post("/v1/jobs", json={"prompt": "hi", **body})
        assert response.status_code == 202, response.text
        job_id: str = response.json()["id"]
        return job_id

    start = utcnow()
    done = dict(result_text="x", finish_reason="stop", prompt_tokens=1, completion_tokens=1, preemptions=0,
                first_token_at=None)
    finishing = [  # (job, seconds after start it succeeds)
        (submit(alice, deadline_s=60, service_tier="priority"), 0),
        (submit(alice, deadline_s=2, service_tier="priority"), 60),  # late
        (submit(alice, deadline_s=60, service_tier="auto"), 0),  # auto: the default tier
        (submit(alice, deadline_s=60), 0),
        (submit(bob, deadline_s=60, service_tier="priority"), 0),
    ]
    for job_id, after_s in finishing:
        assert jobs.claim(session, job_id, "w1", start) is not None
        assert jobs.complete(session, job_id, 1, now=start + timedelta(seconds=after_s), **done)
    missed = submit(alice, deadline_s=60, service_tier="flex")
    assert alice.post(f"/v1/jobs/{missed}/cancel").status_code == 200
    submit(bob, queue="documents")  # queued: counted for bob, and for every tenant

    def listing(client: TestClient, **params: str) -> dict[str, Any]:
        response = client.get("/v1/queues", params=params)
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    def goodput(body: dict[str, Any]) -> dict[str, Any]:
        queue = next(q for q in body["data"] if q["name"] == "interactive")
        return {"all": queue["deadlines_last_hour"], **queue["deadlines_last_hour_by_tier"]}

    def queued(body: dict[str, Any]) -> dict[str, int]:
        return {q["name"]: q["queued"] for q in body["data"]}

    mine = listing(alice)
    assert goodput(mine) == {
        "all": {"on_time": 3, "late": 1, "missed": 1},
        "default": {"on_time": 2, "late": 0, "missed": 0},
        "flex": {"on_time": 0, "late": 0, "missed": 1},
        "priority": {"on_time": 1, "late": 1, "missed": 0},
    }
    assert listing(alice, tenant="alice") == mine  # naming its own tenant changes nothing
    every = listing(admin)
    assert (every["scope"], every["tenant"]) == ("all", "ops")
    assert queued(every) == {"interactive": 0, "documents": 1}
    assert goodput(every)["priority"] == {"on_time": 2, "late": 1, "missed": 0}
    assert goodput(every)["all"] == {"on_time": 4, "late": 1, "missed": 1}

    bobs = listing(admin, tenant="bob")  # the listing as bob sees it
    assert (bobs["scope"], bobs["tenant"]) == ("tenant", "bob")
    assert queued(bobs) == {"interactive": 0, "documents": 1} and queued(mine)["documents"] == 0
    assert goodput(bobs) == {"all": {"on_time": 1, "late": 0, "missed": 0},
                             "priority": {"on_time": 1, "late": 0, "missed": 0}}
    assert listing(admin, tenant="alice")["data"] == mine["data"]
    assert goodput(listing(admin, tenant="nobody")) == {"all": {"on_time": 0, "late": 0, "missed": 0}}

    refused = alice.get("/v1/queues", params={"tenant": "bob"})
    assert refused.status_code == 403, refused.text
    assert error_of(refused)["code"] == "tenant_not_permitted" and error_of(refused)["field"] == "tenant"
    for bad in ("a\x00b", "t" * 65):
        invalid = admin.get("/v1/queues", params={"tenant": bad})
        assert invalid.status_code == 422 and error_of(invalid)["field"] == "tenant", invalid.text


def test_a_job_that_cannot_make_its_deadline_is_refused_when_it_asks(alice: TestClient, session: Session,
                                                                     ) -> None:
    earlier = alice.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 30}).json()["id"]
    assert jobs.claim(session, earlier, "w1", utcnow()) is not None
    assert jobs.complete(session, earlier, 1, result_text="x", finish_reason="length", prompt_tokens=1,
                         completion_tokens=30, preemptions=0, first_token_at=None, now=utcnow())
    # The queue delivered 30 tokens in the last 5 minutes (0.1 token/s): 100 more take about 1000 s.
    body = {"prompt": "hi", "max_tokens": 100, "deadline_s": 60}
    refused = alice.post("/v1/jobs", json={**body, "on_deadline_miss": "reject"})
    assert refused.status_code == 429, refused.text
    assert error_of(refused)["code"] == "deadline_unattainable" and error_of(refused)["field"] == "deadline_s"
    assert 900 <= int(refused.headers["Retry-After"]) <= 1000
    accepted = alice.post("/v1/jobs", json=body).json()
    predicted = datetime.fromisoformat(accepted["predicted_finish_at"])
    assert predicted > datetime.fromisoformat(accepted["deadline_at"])  # taken, and said to be late
    without = alice.post("/v1/jobs", json={"prompt": "hi"}).json()
    assert without["predicted_finish_at"] is None  # no deadline: no prediction
    # The OpenAI routes take the same choice, and answer the refusal in OpenAI's shape.
    openai_refused = alice.post("/v1/completions", json={**body, "on_deadline_miss": "reject"})
    assert openai_refused.status_code == 429, openai_refused.text
    error = openai_refused.json()["error"]
    assert (error["code"], error["param"]) == ("deadline_unattainable", "deadline_s")
    assert int(openai_refused.headers["Retry-After"]) >= 900
    bad = alice.post("/v1/completions", json={**body, "on_deadline_miss": "maybe"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "on_deadline_miss", bad.text
