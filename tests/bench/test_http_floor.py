"""The HTTP floor (bench/http_floor.py) answers the service bench as the jobs API does, so that the bench's
server CPU per job against it is the floor the service is measured against."""

from __future__ import annotations

import httpx
from fastapi.testclient import TestClient

from conveyor.bench.http_floor import floor_app
from conveyor.bench.http_target import run_http
from conveyor.bench.service import service_figures
from conveyor.bench.workload import WorkloadSpec, service_requests


def test_the_service_bench_completes_every_job_against_the_floor() -> None:
    requests = service_requests(WorkloadSpec(profile="service", num_requests=12))
    result = run_http("http://floor", requests, concurrency=4, transport=httpx.ASGITransport(app=floor_app()))
    figures = service_figures(result)
    assert (figures["submitted"], figures["succeeded"], figures["failed"]) == (12, 12, 0)


def test_the_floor_validates_the_body_and_answers_each_job_by_its_id() -> None:
    client = TestClient(floor_app())
    assert client.post("/v1/jobs", json={"prompt": "x", "max_tokens": "many"}).status_code == 422
    job = client.post("/v1/jobs", json={"prompt": "x", "max_tokens": 1})
    assert job.status_code == 202 and job.json()["status"] == "queued"
    answer = client.get(f"/v1/jobs/{job.json()['id']}", params={"wait": 30}).json()
    assert (answer["id"], answer["status"]) == (job.json()["id"], "succeeded")
