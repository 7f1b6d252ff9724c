"""POST /v1/queues/{name}/purge: a tenant's queued jobs of a queue cancelled in one call (in chunks), others'
and running jobs left alone; an admin key purges every tenant's (SQLite and PostgreSQL)."""

from __future__ import annotations

from fastapi.testclient import TestClient
from sqlalchemy import func, select

from conveyor.core.clock import utcnow
from conveyor.core.lanes import lane_of
from conveyor.core.lifecycle import CANCELLED, QUEUED, RUNNING
from conveyor.core.store import jobs, keys
from conveyor.core.store.tables import Job
from tests.support.service import Service, error_of


def park(service: Service, tenant: str, count: int, queue: str = "interactive") -> list[str]:
    """`count` queued jobs of `tenant`, straight into the store (a submit each would take minutes)."""
    lane = lane_of(service.settings.default_model_id(), queue)
    with service.session_factory() as session:
        keys.ensure_tenant(session, tenant, utcnow())
        session.commit()
        return [jobs.add(session, jobs.NewJob(
            tenant_id=tenant, queue=lane, prompt="x", messages=None, params={"max_tokens": 1}, meta=None,
            webhook=None, idempotency_key=None, request_hash="h", prompt_tokens=1, ttl_s=None, timeout_s=None,
        ), utcnow()).id for _ in range(count)]


def statuses(service: Service, tenant: str) -> dict[str, int]:
    with service.session_factory() as session:
        rows = session.execute(select(Job.status, func.count()).where(Job.tenant_id == tenant)
                               .group_by(Job.status)).all()
    return {status: count for status, count in rows}


def test_a_purge_cancels_exactly_the_callers_queued_jobs_of_that_queue(service: Service) -> None:
    a = service.client("tenant-a")
    submitted = a.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 1})
    assert submitted.status_code == 202, submitted.text
    park(service, "tenant-a", 999)
    park(service, "tenant-a", 3, queue="documents")  # another queue: kept
    park(service, "tenant-b", 10)
    running = park(service, "tenant-a", 1)[0]
    with service.session_factory() as session:
        jobs.claim(session, running, "w-1", utcnow())

    purged = a.post("/v1/queues/interactive/purge")
    assert purged.status_code == 200, purged.text
    assert purged.json() == {"queue": "interactive", "cancelled": 1000, "tenant": "tenant-a"}
    assert statuses(service, "tenant-a") == {CANCELLED: 1000, QUEUED: 3, RUNNING: 1}
    assert statuses(service, "tenant-b") == {QUEUED: 10}
    job = a.get(f"/v1/jobs/{submitted.json()['id']}").json()
    assert job["status"] == "cancelled" and job["error"]["message"] == "cancelled by a purge of its queue"
    assert a.post("/v1/queues/interactive/purge").json()["cancelled"] == 0


def test_a_purge_cancels_scheduled_jobs_too(service: Service) -> None:
    a = service.client("tenant-a")
    later = a.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 1, "delay_s": 3600})
    assert later.status_code == 202 and later.json()["status"] == "scheduled", later.text
    assert a.post("/v1/queues/interactive/purge").json()["cancelled"] == 1
    assert a.get(f"/v1/jobs/{later.json()['id']}").json()["status"] == "cancelled"


def test_an_admin_key_purges_every_tenants_jobs(service: Service) -> None:
    park(service, "tenant-a", 4, queue="documents")
    park(service, "tenant-b", 6, queue="documents")
    with service.session_factory() as session:
        _, key = keys.create_key(session, "ops", utcnow(), admin=True)
    purged = service.client_with_key(key).post("/v1/queues/documents/purge")
    assert purged.json() == {"queue": "documents", "cancelled": 10, "tenant": None}
    assert statuses(service, "tenant-a") == {CANCELLED: 4} and statuses(service, "tenant-b") == {CANCELLED: 6}


def test_an_unknown_queue_or_model_is_404(service: Service, alice: TestClient) -> None:
    unknown = alice.post("/v1/queues/bulk/purge")
    assert unknown.status_code == 404 and error_of(unknown)["field"] == "name"
    model = alice.post("/v1/queues/interactive/purge", params={"model": "nope"})
    assert model.status_code == 404 and error_of(model)["code"] == "model_not_found"
    assert service.http.post("/v1/queues/interactive/purge").status_code == 401  # no key
