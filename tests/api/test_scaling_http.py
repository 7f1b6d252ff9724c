"""/v1/scaling: the signal workers scale on (per queue: queued, running, load, live workers, max_running),
behind the metrics token like /metrics. Runs on SQLite and on Postgres (the grouped count)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import httpx
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from conveyor.api.routes.scaling import SCALING_PATH
from conveyor.core.clock import utcnow
from conveyor.core.settings import QueueSettings
from conveyor.core.store import jobs, workers
from conveyor.core.store.database import make_db_engine, make_session_factory
from tests.support.service import LOCAL_URL, Service, error_of

TOKEN = "metrics-token-for-scaling"
BEARER = {"Authorization": f"Bearer {TOKEN}"}


def _complete(session: Session, job_id: str) -> None:
    assert jobs.complete(session, job_id, 1, result_text="t", finish_reason="stop", prompt_tokens=1,
                         completion_tokens=1, preemptions=0, first_token_at=None, now=utcnow())


def test_load_counts_queued_and_running_jobs_and_live_workers_per_queue(
    make_service: Callable[..., Service], session: Session
) -> None:
    queues = {"interactive": QueueSettings(max_running=5), "documents": QueueSettings(max_running=2),
              "idle": QueueSettings(max_running=1)}
    # dead after 60 s, not the tests' 2 s: a loaded CI machine took longer than that between the registrations
    # and the read, and the live workers counted 0
    svc = make_service(metrics_token=TOKEN, queues=queues, worker_dead_after_s=60.0)
    alice = svc.client("alice")
    ids = [alice.post("/v1/jobs", json={"prompt": "x", "queue": q}).json()["id"]
           for q in ("interactive", "interactive", "interactive", "documents")]
    assert jobs.claim(session, ids[0], "w1", utcnow()) is not None  # held by a worker: still load
    assert jobs.claim(session, ids[1], "w1", utcnow()) is not None
    _complete(session, ids[1])  # finished: no longer load
    workers.register(session, "w1", hostname="h", pid=1,
                     queues=["demo-model:interactive", "demo-model:documents"], now=utcnow())
    workers.register(session, "w2", hostname="h", pid=2, queues=["demo-model:documents"], now=utcnow())
    silent = utcnow() - timedelta(seconds=svc.settings.worker_dead_after_s + 1)
    workers.register(session, "w-silent", hostname="h", pid=3, queues=["demo-model:interactive"], now=silent)

    r = svc.http.get(SCALING_PATH, headers=BEARER)
    assert r.status_code == 200, r.text
    per_queue = {
        "interactive": {"queued": 1, "running": 1, "load": 2, "workers": 1, "max_running": 5},
        "documents": {"queued": 1, "running": 0, "load": 1, "workers": 2, "max_running": 2},
        "idle": {"queued": 0, "running": 0, "load": 0, "workers": 0, "max_running": 1},
    }
    assert r.json() == {"models": {"demo-model": {"load": 3, "queues": per_queue}}, "queues": per_queue}

    workers.mark_stopped(session, "w2", utcnow())  # a worker scaled down stops counting at once
    _complete(session, ids[0])
    after = svc.http.get(SCALING_PATH, headers=BEARER).json()["queues"]
    assert after["interactive"]["load"] == 1 and after["documents"]["workers"] == 1


def test_scaling_takes_the_metrics_token_never_a_tenant_key(make_service: Callable[..., Service]) -> None:
    svc = make_service(metrics_token=TOKEN)  # auth on
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
        _assert_unauthorized(svc.http.get(SCALING_PATH, headers=headers))
    _assert_unauthorized(svc.client("alice").get(SCALING_PATH))
    assert svc.http.get(SCALING_PATH, headers=BEARER).status_code == 200

    closed = make_service()  # auth on, no metrics token: closed, as /metrics is
    _assert_unauthorized(closed.http.get(SCALING_PATH, headers=BEARER))
    open_ = make_service(auth_enabled=False)  # loopback, no token: open, as /metrics is
    assert open_.http.get(SCALING_PATH).status_code == 200


def test_refused_before_any_query_and_503_when_the_store_is_down(
    make_service: Callable[..., Service], tmp_path: Path
) -> None:
    svc = make_service(metrics_token=TOKEN)
    broken = make_session_factory(make_db_engine(f"sqlite:///{tmp_path}/missing-dir/none.db"))
    svc.http.app.state.services = replace(svc.http.app.state.services, session_factory=broken)
    client = TestClient(svc.http.app, base_url=LOCAL_URL, raise_server_exceptions=False)
    _assert_unauthorized(client.get(SCALING_PATH))  # the store is never asked for a refused caller
    r = client.get(SCALING_PATH, headers=BEARER)
    assert r.status_code == 503 and error_of(r)["code"] == "store_unavailable"


def _assert_unauthorized(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    error = error_of(response)
    assert error["code"] == "unauthorized" and error["field"] == "Authorization"
    assert response.headers["WWW-Authenticate"] == "Bearer"
