"""A tenant's costly schema stalls no other tenant, end to end: an embedded server with auth on (HTTP -> store
-> in-process queue -> EmbeddedRuntime -> engine), SQLite and Postgres. The probe's case: a JSON schema of
thousands of optional integer properties takes seconds to minutes to compile; meanwhile another tenant's jobs
start and finish, and the costly job fails on its own (invalid_request naming the limit) or is cancelled.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.core.settings import Settings
from tests.support.service import embedded_tenants

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=192, block_size=16, dtype="float32",
              device="cpu", attention_backend="torch")
WAIT_S = 120.0  # a hang guard, not a speed assertion
# 47 KB, 2,001 objects: under the submit bound on objects, and minutes to compile on the demo model.
COSTLY = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}}


def costly_job() -> dict[str, Any]:
    return {"prompt": "The queue holds", "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": COSTLY}}}


@pytest.fixture
def server(
    database_url: str, make_settings: Callable[..., Settings], demo_model_dir: Path,
    prompt_tokenizer: PromptTokenizer, session_factory: sessionmaker[Session], timeout_s: float,
) -> Iterator[Callable[[str], TestClient]]:
    """A client factory (the client of a tenant, with a fresh key); the compile limit is the test's
    `timeout_s` parameter."""
    settings = make_settings(database_url=database_url, model=str(demo_model_dir), auth_enabled=True,
                             grammar_compile_timeout_s=timeout_s, **ENGINE)
    with embedded_tenants(settings, prompt_tokenizer, session_factory) as client:
        yield client


def submit(client: TestClient, body: dict[str, Any]) -> str:
    created = client.post("/v1/jobs", json=body)
    assert created.status_code == 202, created.text
    return str(created.json()["id"])


def wait_final(client: TestClient, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        job: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] not in ("queued", "running"):
            return job
        time.sleep(0.02)
    raise AssertionError(f"job {job_id} never finished")


@pytest.mark.parametrize("timeout_s", [600.0])
def test_another_tenants_jobs_run_while_a_costly_schema_compiles(server) -> None:
    hostile, other = server("tenant-a"), server("tenant-b")
    costly = submit(hostile, costly_job())
    time.sleep(0.2)  # the costly job is claimed and compiling before the others arrive
    body = {"max_tokens": 4, "temperature": 0}
    jobs = [submit(other, {"prompt": f"Job {i} of twenty", **body}) for i in range(20)]
    assert all(wait_final(other, job_id)["status"] == "succeeded" for job_id in jobs)
    # Twenty jobs took well under a second; the schema takes far longer on this model (minutes, measured).
    assert hostile.get(f"/v1/jobs/{costly}").json()["status"] == "running", "still compiling"
    assert hostile.post(f"/v1/jobs/{costly}/cancel").status_code == 200
    assert wait_final(hostile, costly)["status"] == "cancelled"


@pytest.mark.parametrize("timeout_s", [0.5])
def test_a_schema_that_does_not_compile_in_time_fails_its_job_alone(server) -> None:
    hostile, other = server("tenant-a"), server("tenant-b")
    costly = submit(hostile, costly_job())
    fine = submit(other, {"prompt": "A block table", "max_tokens": 4, "temperature": 0})
    job = wait_final(hostile, costly)
    assert job["status"] == "failed", job
    assert job["error"]["code"] == "invalid_request", job
    assert "did not compile within 0.5 s (grammar_compile_timeout_s)" in job["error"]["message"], job
    assert wait_final(other, fine)["status"] == "succeeded"
