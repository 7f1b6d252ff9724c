"""Scheduled jobs, retries on request and progress, end to end in embedded mode (SQLite and PostgreSQL): HTTP
-> store -> scheduler -> in-process queue -> engine -> store, and the job's event stream fed by the same
token stream as the OpenAI routes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from conveyor.api.app import create_app
from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.core.settings import Settings
from tests.support.live_server import serving, wait_for
from tests.support.sse import job_events

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=192, block_size=16, dtype="float32",
              device="cpu", attention_backend="torch")
WAIT_S = 120.0  # a hang guard, not a speed assertion


@pytest.fixture
def http(database_url: str, make_settings: Callable[..., Settings], demo_model_dir: Path,
         prompt_tokenizer: PromptTokenizer) -> Iterator[httpx.Client]:
    from conveyor.worker.embedded import EmbeddedRuntime

    settings = make_settings(database_url=database_url, model=str(demo_model_dir), auth_enabled=False,
                             schedule_poll_s=0.2, webhook_allowlist=["127.0.0.1"], **ENGINE)
    runtime = EmbeddedRuntime(settings)
    app = create_app(settings, publisher=runtime.publisher, tokenizer=prompt_tokenizer, runtime=runtime,
                     token_stream=runtime.token_stream, finished_watch=runtime.finished,
                     finished_sink=runtime.finished)
    with serving(app) as url, httpx.Client(base_url=url, timeout=WAIT_S) as client:
        yield client


def submit(http: httpx.Client, **body: Any) -> dict[str, Any]:
    answer = http.post("/v1/jobs", json={"prompt": "The river is calm", "max_tokens": 4, **body})
    assert answer.status_code == 202, answer.text
    return dict(answer.json())


def final(http: httpx.Client, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        job = http.get(f"/v1/jobs/{job_id}", params={"wait": 30}).json()
        if job["status"] in ("succeeded", "failed", "cancelled", "expired"):
            return dict(job)
    raise AssertionError(f"{job_id} did not finish within {WAIT_S} s")


def moment(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def queue_counts(http: httpx.Client) -> dict[str, int]:
    [interactive] = [q for q in http.get("/v1/queues").json()["data"] if q["name"] == "interactive"]
    return {key: interactive[key] for key in ("scheduled", "queued")}


def test_a_delayed_job_is_scheduled_then_starts_no_earlier_than_due_and_succeeds(http: httpx.Client) -> None:
    job = submit(http, delay_s=3)
    assert job["status"] == "scheduled" and job["run_at"] is not None
    due = moment(job["run_at"])
    assert 2.9 <= (due - moment(job["created_at"])).total_seconds() <= 3.1
    assert queue_counts(http) == {"scheduled": 1, "queued": 0}  # apart from the queue's depth
    done = final(http, job["id"])
    assert done["status"] == "succeeded", done
    assert moment(done["started_at"]) >= due
    assert queue_counts(http) == {"scheduled": 0, "queued": 0}


def test_scheduling_mistakes_are_422_naming_the_field(http: httpx.Client) -> None:
    both = http.post("/v1/jobs", json={"prompt": "x", "delay_s": 1, "run_at": "2030-01-01T00:00:00Z"})
    assert both.status_code == 422 and "run_at or delay_s" in both.text
    naive = http.post("/v1/jobs", json={"prompt": "x", "run_at": "2030-01-01T00:00:00"})
    assert naive.status_code == 422 and "run_at" in naive.text
    far = http.post("/v1/jobs", json={"prompt": "x", "run_at": "2999-01-01T00:00:00Z"})
    assert far.status_code == 422 and "at most 30 days ahead" in far.text


def test_a_cancelled_job_retried_succeeds_under_its_id_with_both_attempts_in_its_history(
    http: httpx.Client,
) -> None:
    job = submit(http, max_tokens=500, ignore_eos=True, temperature=0)
    wait_for(lambda: http.get(f"/v1/jobs/{job['id']}").json()["status"] == "running", "the job to run",
             timeout_s=WAIT_S)
    cancelled = http.post(f"/v1/jobs/{job['id']}/cancel").json()
    assert cancelled["status"] == "cancelled", cancelled
    headers = {"Idempotency-Key": "retry-1"}
    retried = http.post(f"/v1/jobs/{job['id']}/retry", headers=headers)
    assert retried.status_code == 202, retried.text
    assert retried.json()["status"] == "queued" and retried.json()["error"] is None
    replay = http.post(f"/v1/jobs/{job['id']}/retry", headers=headers)
    assert replay.status_code == 200 and replay.json()["id"] == job["id"]

    done = final(http, job["id"])
    assert (done["id"], done["status"], done["attempts"]) == (job["id"], "succeeded", 2), done
    assert [(h["attempt"], h["status"]) for h in done["history"]] == [(1, "cancelled"), (2, "succeeded")]
    assert done["history"][0]["error"]["code"] == "cancelled"
    since_retry = (moment(done["started_at"]) - moment(done["run_at"])).total_seconds()
    assert done["queue_time_s"] == pytest.approx(since_retry, abs=1e-3)  # counted from the retry
    assert moment(done["run_at"]) > moment(done["created_at"])
    again = http.post(f"/v1/jobs/{job['id']}/retry")
    assert again.status_code == 409 and "is succeeded" in again.text


def test_retrying_a_waiting_job_is_409_and_an_unknown_one_404(http: httpx.Client) -> None:
    waiting = submit(http, delay_s=600)
    refused = http.post(f"/v1/jobs/{waiting['id']}/retry")
    assert refused.status_code == 409 and "is scheduled" in refused.text, refused.text
    assert http.post("/v1/jobs/job_0123456789abcdef0123456789abcdef/retry").status_code == 404
    assert http.post(f"/v1/jobs/{waiting['id']}/cancel").json()["status"] == "cancelled"
    later = http.post(f"/v1/jobs/{waiting['id']}/retry", json={"delay_s": 600}).json()
    assert later["status"] == "scheduled" and [h["status"] for h in later["history"]] == ["cancelled"]
    assert http.delete(f"/v1/jobs/{waiting['id']}").status_code == 200  # a scheduled job is deletable


def test_the_events_stream_delivers_the_text_as_deltas_before_the_final_job(http: httpx.Client) -> None:
    job = submit(http, max_tokens=64, ignore_eos=True, temperature=0, delay_s=1)  # starts after we listen
    with http.stream("GET", f"/v1/jobs/{job['id']}/events") as stream:
        assert stream.status_code == 200
        events = list(job_events(stream.iter_lines()))
    kinds = [kind for kind, _ in events]
    deltas = [data for kind, data in events if kind == "delta"]
    assert kinds[0] == "job" and kinds[-1] == "job" and events[-1][1]["status"] == "succeeded", kinds
    assert len(deltas) >= 8, kinds
    assert max(i for i, kind in enumerate(kinds) if kind == "delta") < len(kinds) - 1  # then the final job
    assert "".join(d["text"] for d in deltas) == events[-1][1]["result"]["text"]
    assert deltas[-1]["tokens"] == 64 and {d["attempt"] for d in deltas} == {1}


def test_a_webhook_asking_for_job_started_gets_it_then_its_final_event(http: httpx.Client) -> None:
    hook = {"url": "http://127.0.0.1:9/hook", "events": ["job.started", "job.succeeded"]}
    asked, plain = submit(http, webhook=hook), submit(http, webhook={"url": "http://127.0.0.1:9/plain"})
    for job in (asked, plain):
        assert final(http, job["id"])["status"] == "succeeded"

    def events_of(job_id: str) -> list[str]:
        return sorted(d["event_type"] for d in http.get(f"/v1/jobs/{job_id}/deliveries").json()["data"])

    assert events_of(asked["id"]) == ["job.started", "job.succeeded"]
    assert events_of(plain["id"]) == ["job.succeeded"]  # job.started is opt-in
