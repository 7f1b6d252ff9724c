"""End to end in embedded mode: HTTP -> store -> in-process queue -> EmbeddedRuntime -> engine -> store,
on SQLite and on Postgres. A greedy job's text equals the offline engine's for the same prompt."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from conveyor.api.app import create_app
from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.core.settings import Settings
from tests.support.live_server import free_port
from tests.support.service import LOCAL_URL

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=192, block_size=16, dtype="float32",
              device="cpu", attention_backend="torch")
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
WAIT_S = 120.0  # a hang guard, not a speed assertion


@pytest.fixture(scope="module")
def offline(demo_model_dir: Path) -> Any:
    from conveyor.engine import LLM

    return LLM(str(demo_model_dir), **ENGINE)


@pytest.fixture
def embedded(
    database_url: str, make_settings: Callable[..., Settings], demo_model_dir: Path,
    prompt_tokenizer: PromptTokenizer,
) -> Iterator[TestClient]:
    from conveyor.worker.embedded import EmbeddedRuntime

    settings = make_settings(database_url=database_url, model=str(demo_model_dir), auth_enabled=False,
                             **ENGINE)
    runtime = EmbeddedRuntime(settings)
    app = create_app(settings, publisher=runtime.publisher, tokenizer=prompt_tokenizer, runtime=runtime)
    with TestClient(app, base_url=LOCAL_URL) as client:
        yield client


def wait_until(client: TestClient, job_id: str, statuses: set[str]) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        job: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in statuses:
            return job
        time.sleep(0.02)
    raise AssertionError(f"job {job_id} never reached {statuses}: {job}")


def test_jobs_in_both_queues_complete_with_offline_text(embedded: TestClient, offline: Any) -> None:
    from conveyor.engine import SamplingParams

    prompt = "The queue holds jobs until a worker is free."
    messages = [{"role": "user", "content": "Write a haiku about queues."}]
    submitted = [
        embedded.post("/v1/jobs", json={"prompt": prompt, "queue": "interactive", **GREEDY}),
        embedded.post("/v1/jobs", json={"prompt": prompt, "queue": "documents", **GREEDY}),
        embedded.post("/v1/jobs", json={"messages": messages, "queue": "documents", **GREEDY}),
    ]
    assert [r.status_code for r in submitted] == [202, 202, 202]
    done = [wait_until(embedded, r.json()["id"], {"succeeded", "failed"}) for r in submitted]
    assert [j["status"] for j in done] == ["succeeded"] * 3, done

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want_prompt = offline.generate([prompt], params)[0]
    want_chat = offline.chat(messages, params)[0]
    assert done[0]["result"]["text"] == done[1]["result"]["text"] == want_prompt.text
    assert done[2]["result"]["text"] == want_chat.text
    for job, want in zip(done, (want_prompt, want_prompt, want_chat), strict=True):
        usage = job["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(want.prompt_token_ids), 12)
        assert 0 <= usage["cached_tokens"] < usage["prompt_tokens"]  # the same prompt twice may share blocks
        assert job["result"]["finish_reason"] == "length" and job["attempts"] == 1
        assert job["queue_time_s"] <= job["time_to_first_token_s"] <= job["end_to_end_s"]

    ready = embedded.get("/readyz")
    assert ready.status_code == 200, ready.text  # the embedded runtime is a live worker


def test_logprobs_hold_three_alternatives_and_the_offline_sampled_logprob(
    embedded: TestClient, offline: Any, demo_model_dir: Path,
) -> None:
    from conveyor.engine import SamplingParams
    from conveyor.engine.tokenizer import Tokenizer

    prompt = "Logprobs tell how sure the model was."
    plain = embedded.post("/v1/jobs", json={"prompt": prompt, **GREEDY}).json()
    asked = embedded.post("/v1/jobs", json={"prompt": prompt, "logprobs": 3, **GREEDY}).json()
    plain, asked = (wait_until(embedded, j["id"], {"succeeded", "failed"}) for j in (plain, asked))
    assert plain["status"] == asked["status"] == "succeeded", (plain, asked)
    assert plain["result"]["logprobs"] is None  # not asked for: null

    want = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                     logprobs=3))[0]
    tokenizer = Tokenizer(demo_model_dir)
    got = asked["result"]["logprobs"]
    assert [t["token_id"] for t in got] == want.token_ids and len(got) == 12
    for token, entry, offline_entry in zip(want.token_ids, got, want.logprobs, strict=True):
        assert entry["logprob"] == pytest.approx(offline_entry[token], abs=1e-4)
        assert entry["text"] == tokenizer.decode([token], skip_special_tokens=False)
        alternatives = entry["top_logprobs"]
        assert len(alternatives) == 3
        values = [a["logprob"] for a in alternatives]
        assert values == sorted(values, reverse=True)
        assert alternatives[0]["token_id"] == token  # greedy: the sampled token is the most likely one
        assert {a["token_id"] for a in alternatives} <= set(offline_entry)


def test_cancel_running_job_then_serve_the_next(embedded: TestClient) -> None:
    body = {"prompt": "Tell a long story.", "max_tokens": 900, "queue": "documents", "ignore_eos": True}
    long = embedded.post("/v1/jobs", json=body).json()
    wait_until(embedded, long["id"], {"running", "succeeded"})
    cancelled = embedded.post(f"/v1/jobs/{long['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    short = embedded.post("/v1/jobs", json={"prompt": "Hi", **GREEDY}).json()
    assert wait_until(embedded, short["id"], {"succeeded", "failed"})["status"] == "succeeded"
    after = embedded.get(f"/v1/jobs/{long['id']}").json()
    assert after["status"] == "cancelled" and after["result"] is None  # no late completion overwrote it


def test_cli_client_against_a_real_server(
    sqlite_url: str, make_settings: Callable[..., Settings], demo_model_dir: Path,
    prompt_tokenizer: PromptTokenizer,
) -> None:
    import uvicorn

    from conveyor.cli.main import app as cli
    from conveyor.core.store.migrate import upgrade
    from conveyor.worker.embedded import EmbeddedRuntime

    upgrade(sqlite_url)
    settings = make_settings(database_url=sqlite_url, model=str(demo_model_dir), auth_enabled=False, **ENGINE)
    runtime = EmbeddedRuntime(settings)
    app = create_app(settings, publisher=runtime.publisher, tokenizer=prompt_tokenizer, runtime=runtime)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        _wait_for_port(port)
        url = f"http://127.0.0.1:{port}"
        runner = CliRunner()
        submitted = runner.invoke(cli, ["submit", "Good morning!", "--max-tokens", "4", "--url", url])
        assert submitted.exit_code == 0, submitted.output
        job_id = json.loads(submitted.output)["id"]
        waited = runner.invoke(cli, ["wait", job_id, "--poll", "0.05", "--timeout", "120", "--url", url])
        assert waited.exit_code == 0, waited.output
        assert json.loads(waited.output)["status"] == "succeeded"
        status = runner.invoke(cli, ["status", "job_missing", "--url", url])
        assert status.exit_code == 2 and "HTTP 404" in status.output
    finally:
        server.should_exit = True
        thread.join(timeout=30)



def _wait_for_port(port: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"server never listened on {port}")
