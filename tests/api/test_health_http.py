"""/readyz (database and broker: this API can take jobs) and /metrics."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import Session

from conveyor.core.clock import utcnow
from conveyor.core.settings import Settings
from conveyor.core.store import jobs, workers
from conveyor.core.store.database import make_db_engine, make_session_factory
from conveyor.core.store.outcome_counts import JOB_DEADLINES
from conveyor.core.store.tables import MetricCount
from tests.support.service import LOCAL_URL, RecordingPublisher, Service

METRICS_TOKEN = "metrics-token-for-these-tests"


@pytest.fixture
def make_settings(make_settings: Callable[..., Settings]) -> Callable[..., Settings]:
    """Auth is on in these services, so /metrics needs its token (tests/api/test_exposure_http.py)."""
    return functools.partial(make_settings, metrics_token=METRICS_TOKEN)

MODEL = ("model", "demo-model")  # the label of every per-queue series of the tests' model
LANES = ["demo-model:interactive", "demo-model:documents"]


def samples(service: Service) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = service.http.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    assert response.status_code == 200, response.text
    text = response.text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_ready_without_any_worker_not_ready_without_the_broker(
    make_service: Callable[..., Service], session: Session
) -> None:
    """Readiness means "this API can take jobs": workers may have scaled to zero, the jobs wait queued."""
    publisher = RecordingPublisher(reachable=False)
    svc = make_service(publisher=publisher)
    r = svc.http.get("/readyz")
    assert r.status_code == 503
    body = r.json()
    assert body["ready"] is False
    assert body["checks"] == {"database": {"ok": True, "detail": "reachable"},
                              "broker": {"ok": False, "detail": "unreachable"}}

    publisher.reachable = True
    assert workers.live_workers(session, now=utcnow(), dead_after_s=svc.settings.worker_dead_after_s) == []
    r = svc.http.get("/readyz")
    assert r.status_code == 200, r.text
    assert r.json() == {"ready": True, "checks": {"database": {"ok": True, "detail": "reachable"},
                                                  "broker": {"ok": True, "detail": "reachable"}}}
    assert svc.client("alice").post("/v1/jobs", json={"prompt": "x"}).status_code == 202


def test_metrics_report_load_and_live_workers_per_queue(service: Service, session: Session) -> None:
    alice = service.client("alice")
    ids = [alice.post("/v1/jobs", json={"prompt": "x", "queue": q}).json()["id"]
           for q in ("documents", "documents", "documents")]
    assert jobs.claim(session, ids[0], "w1", utcnow()) is not None
    workers.register(session, "w1", hostname="h", pid=1, queues=["demo-model:documents"], now=utcnow())
    stale = utcnow() - timedelta(seconds=service.settings.worker_dead_after_s + 1)
    workers.register(session, "w-old", hostname="h", pid=2, queues=LANES, now=stale)

    m = samples(service)
    assert m[("conveyor_queue_load", (MODEL, ("queue", "documents")))] == 3  # 2 queued + 1 running
    assert m[("conveyor_queue_load", (MODEL, ("queue", "interactive")))] == 0
    assert m[("conveyor_queue_workers", (MODEL, ("queue", "documents")))] == 1
    # A silent worker is not live.
    assert m[("conveyor_queue_workers", (MODEL, ("queue", "interactive")))] == 0


def test_metrics_count_submissions_rejections_queues_and_outcomes(service: Service, session: Session) -> None:
    alice = service.client("alice")
    ids = [
        alice.post("/v1/jobs", json={"prompt": "x", "queue": q}).json()["id"]
        for q in ("interactive", "interactive", "documents")
    ]
    alice.post("/v1/jobs", json={"prompt": "x", "queue": "nope"})
    alice.post("/v1/jobs", json={"prompt": "x", "max_tokens": 100000})
    alice.post("/v1/jobs", json={"prompt": "x", "queue": "documents", "delay_s": 600})
    alice.get("/v1/jobs/job_missing")
    assert jobs.claim(session, ids[0], "w1", utcnow()) is not None
    assert jobs.complete(
        session,
        ids[0],
        1,
        result_text="t",
        finish_reason="stop",
        prompt_tokens=1,
        completion_tokens=1,
        preemptions=3,
        first_token_at=None,
        now=utcnow(),
    )
    assert jobs.claim(session, ids[2], "w1", utcnow()) is not None

    m = samples(service)
    assert m[("conveyor_jobs_submitted_total", (MODEL, ("queue", "interactive")))] == 2
    assert m[("conveyor_jobs_submitted_total", (MODEL, ("queue", "documents")))] == 2  # one of them scheduled
    assert m[("conveyor_jobs_rejected_total", (("code", "unknown_queue"), MODEL, ("queue", "unknown")))] == 1
    too_large = ("conveyor_jobs_rejected_total",
                 (("code", "max_tokens_too_large"), MODEL, ("queue", "interactive")))
    assert m[too_large] == 1
    assert m[("conveyor_queue_depth", (MODEL, ("queue", "interactive")))] == 1
    assert m[("conveyor_queue_depth", (MODEL, ("queue", "documents")))] == 0  # the scheduled one: apart
    assert m[("conveyor_queue_scheduled", (MODEL, ("queue", "documents")))] == 1
    assert m[("conveyor_queue_scheduled", (MODEL, ("queue", "interactive")))] == 0
    assert m[("conveyor_queue_load", (MODEL, ("queue", "documents")))] == 1  # running, not scheduled
    assert m[("conveyor_queue_running", (MODEL, ("queue", "documents")))] == 1
    assert m[("conveyor_queue_oldest_age_seconds", (MODEL, ("queue", "interactive")))] >= 0
    finished = ("conveyor_jobs_finished_total", (MODEL, ("queue", "interactive"), ("status", "succeeded")))
    assert m[finished] == 1
    assert m[("conveyor_job_preemptions_total", (MODEL, ("queue", "interactive")))] == 3
    not_found = (
        "conveyor_http_responses_total",
        (("method", "GET"), ("route", "/v1/jobs/{job_id}"), ("status", "404")),
    )
    assert m[not_found] == 1
    accepted = (
        "conveyor_http_responses_total",
        (("method", "POST"), ("route", "/v1/jobs"), ("status", "202")),
    )
    assert m[accepted] == 4


def test_metrics_count_deadline_outcomes_per_tier_with_older_rows_as_the_default_tier(
    service: Service, session: Session
) -> None:
    alice = service.client("alice")
    done = dict(result_text="t", finish_reason="stop", prompt_tokens=1, completion_tokens=1, preemptions=0,
                first_token_at=None)
    for tier in ("priority", "default", None):
        body = {"prompt": "x", "deadline_s": 600, **({"service_tier": tier} if tier else {})}
        job_id = alice.post("/v1/jobs", json=body).json()["id"]
        assert jobs.claim(session, job_id, "w1", utcnow()) is not None
        assert jobs.complete(session, job_id, 1, now=utcnow(), **done)
    flex_job = {"prompt": "x", "deadline_s": 600, "service_tier": "flex"}
    flex = alice.post("/v1/jobs", json=flex_job).json()["id"]
    assert alice.post(f"/v1/jobs/{flex}/cancel").status_code == 200
    # Counted by an older release, before tiers were: status "", read as the default tier.
    session.add(MetricCount(metric=JOB_DEADLINES, queue="demo-model:interactive", status="", label="on_time",
                            count=5,
                            total=0.0))
    session.commit()

    m = samples(service)
    deadlines = {dict(labels)["tier"] + " " + dict(labels)["outcome"]: n
                 for (name, labels), n in m.items() if name == "conveyor_job_deadlines_total"}
    assert deadlines == {"default on_time": 7, "priority on_time": 1, "flex missed": 1}  # one series each
    assert all(dict(labels)["queue"] == "interactive"
               for name, labels in m if name == "conveyor_job_deadlines_total")


def test_each_app_has_its_own_registry(make_service: Callable[..., Service]) -> None:
    first, second = make_service(), make_service()
    first.client("alice").post("/v1/jobs", json={"prompt": "x"})
    key = ("conveyor_jobs_submitted_total", (MODEL, ("queue", "interactive")))
    assert samples(first)[key] == 1
    assert key not in samples(second)


def test_store_outage_is_503_in_the_error_shape(make_service: Callable[..., Service], tmp_path: Path) -> None:
    svc = make_service()
    broken = make_session_factory(make_db_engine(f"sqlite:///{tmp_path}/missing-dir/none.db"))
    svc.http.app.state.services = replace(svc.http.app.state.services, session_factory=broken)
    client = TestClient(svc.http.app, base_url=LOCAL_URL, raise_server_exceptions=False)
    r = client.post("/v1/jobs", json={"prompt": "x"}, headers={"Authorization": "Bearer cvk_x"})
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    assert r.json()["error"]["code"] == "store_unavailable"
    ready = client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["checks"]["database"]["ok"] is False
