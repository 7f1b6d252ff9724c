"""The prefix cache is partitioned by tenant, end to end: an embedded server with auth on (HTTP -> store ->
in-process queue -> EmbeddedRuntime -> engine), SQLite and Postgres. A tenant that repeats another tenant's
prompt finds nothing cached (its `cached_tokens` cannot reveal what the other asked), while the other's own
repeat still hits; tenants the operator gave one cache namespace hit each other's prefix; batch lines are
jobs of their tenant and share its partition."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.core.clock import utcnow
from conveyor.core.settings import Settings
from conveyor.core.store import tenants
from tests.support.service import embedded_tenants

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=192, block_size=16, dtype="float32",
              device="cpu", attention_backend="torch")
GREEDY = {"temperature": 0, "max_tokens": 2, "ignore_eos": True}
WAIT_S = 120.0  # a hang guard, not a speed assertion
# B's secret: long enough for several 16-token KV blocks (the demo model's tokenizer gives ~180 tokens).
SECRET = " ".join(f"Clause {i}: the Halvorsen merger closes on Friday at {i} pm." for i in range(12))


@pytest.fixture
def server(
    database_url: str, make_settings: Callable[..., Settings], demo_model_dir: Path,
    prompt_tokenizer: PromptTokenizer, session_factory: sessionmaker[Session],
) -> Iterator[Callable[[str], TestClient]]:
    """A client factory: the client of a tenant, carrying a fresh API key of it."""
    settings = make_settings(database_url=database_url, model=str(demo_model_dir), auth_enabled=True,
                             batch_window_jobs=4, **ENGINE)
    with embedded_tenants(settings, prompt_tokenizer, session_factory) as client:
        yield client


def run_job(client: TestClient, prompt: str) -> dict[str, Any]:
    created = client.post("/v1/jobs", json={"prompt": prompt, **GREEDY})
    assert created.status_code == 202, created.text
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        job: dict[str, Any] = client.get(f"/v1/jobs/{created.json()['id']}").json()
        if job["status"] not in ("queued", "running"):
            assert job["status"] == "succeeded", job
            return job
        time.sleep(0.02)
    raise AssertionError(f"job {created.json()['id']} never finished")


def cached(job: dict[str, Any]) -> int:
    return int(job["usage"]["cached_tokens"])


def test_a_tenant_repeating_another_tenants_prompt_finds_nothing_cached(
    server: Callable[[str], TestClient],
) -> None:
    victim, prober, guesser = server("tenant-b"), server("tenant-a"), server("tenant-c")
    first = run_job(victim, SECRET)
    assert first["usage"]["prompt_tokens"] >= 64 and cached(first) == 0
    assert cached(run_job(prober, SECRET)) == 0, "B's cached prompt is no hit for A"
    assert cached(run_job(guesser, SECRET[: len(SECRET) // 2])) == 0, "nor its first half for C"
    again = run_job(victim, SECRET)
    assert cached(again) >= 48, "B still hits its own prefix"
    assert cached(again) % 16 == 0 and cached(again) < again["usage"]["prompt_tokens"]


def test_tenants_given_one_cache_namespace_hit_each_others_prefix(
    server: Callable[[str], TestClient], session_factory: sessionmaker[Session],
) -> None:
    with session_factory() as session:
        for tenant_id in ("team-1", "team-2"):
            tenants.set_overrides(session, tenant_id, {"cache_namespace": "acme"}, utcnow())
    team_1, team_2, outsider = server("team-1"), server("team-2"), server("acme")
    system_prompt = SECRET + " Answer briefly."
    assert cached(run_job(team_1, system_prompt + " Question one?")) == 0
    shared = run_job(team_2, system_prompt + " Question two?")
    assert cached(shared) >= 48, "the namespace shares the system prompt's blocks"
    assert cached(run_job(outsider, system_prompt + " Question three?")) == 0, \
        "a tenant whose id is the namespace's name is not in it"


def test_batch_lines_share_their_tenants_partition_only(server: Callable[[str], TestClient]) -> None:
    victim, prober = server("tenant-b"), server("tenant-a")
    run_job(victim, SECRET)
    assert cached(run_batch_line(prober, SECRET)) == 0, "another tenant's batch line finds nothing"
    assert cached(run_batch_line(victim, SECRET)) >= 48, "the tenant's own batch line hits its prefix"


def run_batch_line(client: TestClient, prompt: str) -> dict[str, Any]:
    """Runs a one-line /v1/completions batch; returns its output line's job-shaped usage."""
    line = {"custom_id": "q", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": prompt, "max_tokens": 2, "temperature": 0}}
    uploaded = client.post("/v1/files", data={"purpose": "batch"},
                           files={"file": ("in.jsonl", json.dumps(line).encode() + b"\n")})
    assert uploaded.status_code == 200, uploaded.text
    created = client.post("/v1/batches", json={"input_file_id": uploaded.json()["id"],
                                               "endpoint": "/v1/completions", "completion_window": "24h"})
    assert created.status_code in (200, 201, 202), created.text
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        batch: dict[str, Any] = client.get(f"/v1/batches/{created.json()['id']}").json()
        if batch["status"] in ("completed", "failed", "cancelled", "expired"):
            assert batch["status"] == "completed" and batch["output_file_id"], batch
            output = client.get(f"/v1/files/{batch['output_file_id']}/content").text.splitlines()
            usage = json.loads(output[0])["response"]["body"]["usage"]
            return {"usage": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}}
        time.sleep(0.05)
    raise AssertionError(f"batch {created.json()['id']} never closed")
