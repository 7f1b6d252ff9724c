"""The `conveyor` command: migrate, keys create|list|revoke, refusing an unauthenticated public bind,
and the small client against the real app."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from typer.testing import CliRunner

from conveyor.api.app import create_app
from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.cli.http_client import ClientError, ConveyorClient
from conveyor.cli.main import app
from conveyor.core.clock import utcnow
from conveyor.core.seams.finish_notifications import LocalFinishedHub
from conveyor.core.store import jobs
from conveyor.core.store.migrate import upgrade
from tests.support.live_server import free_port, new_api_key, serving, wait_for
from tests.support.service import RecordingPublisher, Service

runner = CliRunner()
REPO_ROOT = Path(__file__).resolve().parents[2]


def test_migrate_creates_the_schema(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "sub" / "c.db"
    monkeypatch.setenv("CONVEYOR_DATABASE_URL", f"sqlite:///{db}")
    result = runner.invoke(app, ["migrate"])
    assert result.exit_code == 0, result.output
    assert db.is_file() and "latest revision" in result.output
    assert "migrated from an empty database to revision" in result.output
    again = runner.invoke(app, ["migrate"])
    assert again.exit_code == 0 and "schema at revision" in again.output, again.output
    assert "alembic" not in again.output + again.stderr  # its INFO lines stay quiet


def test_keys_create_list_revoke(service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_DATABASE_URL", service.settings.database_url)
    created = runner.invoke(app, ["keys", "create", "--tenant", "erin"])
    assert created.exit_code == 0, created.output
    key = json.loads(created.output)
    assert key["tenant"] == "erin" and key["key"].startswith("cvk_")
    client = service.client_with_key(key["key"])
    assert client.post("/v1/jobs", json={"prompt": "x"}).status_code == 202

    listed = runner.invoke(app, ["keys", "list"])
    assert listed.exit_code == 0 and key["id"] in listed.output and key["key"] not in listed.output

    revoked = runner.invoke(app, ["keys", "revoke", key["id"]])
    assert revoked.exit_code == 0, revoked.output
    assert client.get("/v1/jobs").status_code == 401
    again = runner.invoke(app, ["keys", "revoke", key["id"]])
    assert again.exit_code != 0 and "no such active key" in again.output


@pytest.mark.parametrize("command", ["serve", "api"])
def test_refuses_public_bind_without_auth(
    command: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CONVEYOR_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("CONVEYOR_AUTH_ENABLED", "false")
    result = runner.invoke(app, [command, "--host", "0.0.0.0", "--port", "8123"])
    assert result.exit_code == 2
    assert "refusing to listen on non-loopback address '0.0.0.0' with authentication off" in result.output


def test_api_with_a_preset_no_worker_built_says_what_to_do_and_builds_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, redis_url: str
) -> None:
    monkeypatch.setenv("CONVEYOR_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("CONVEYOR_BROKER_URL", redis_url)
    monkeypatch.setenv("CONVEYOR_MODEL", "preset:tiny")
    result = runner.invoke(app, ["api", "--port", "8124"])
    assert result.exit_code == 2
    assert "preset:tiny: not built yet" in result.output and "conveyor worker" in result.output
    assert not (tmp_path / "models").exists()


def test_api_serves_with_only_the_tokenizer_files_of_the_model(
    tmp_path: Path, demo_model_dir: Path, redis_url: str
) -> None:
    """No config.json, no weights: an API that tried to load (or build) a model could not start."""
    folder = tmp_path / "tokenizer-only"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(demo_model_dir / name, folder / name)
    port = free_port()
    upgrade(f"sqlite:///{(tmp_path / 'conveyor.db').resolve()}")  # the default database under the data dir
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(CONVEYOR_MODEL=str(folder), CONVEYOR_BROKER_URL=redis_url, CONVEYOR_DATA_DIR=str(tmp_path),
               PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "conveyor", "api", "--port", str(port)], env=env,
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: _answers(f"http://127.0.0.1:{port}/healthz"), "conveyor api to start")
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["tokenizer-only"]
    finally:
        proc.terminate()
        output = proc.communicate(timeout=60)[0].decode(errors="replace")
    assert not (tmp_path / "models").exists(), output  # nothing converted nor built


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


class AnswerLostOnce:
    """An HTTP client that delivers the first POST, then drops its answer as a reset connection would."""

    def __init__(self, http: httpx.Client) -> None:
        self._http = http
        self.keys: list[str | None] = []

    def post(self, url: str, **kwargs: Any) -> httpx.Response:
        self.keys.append(kwargs.get("headers", {}).get("Idempotency-Key"))
        response = self._http.post(url, **kwargs)
        if len(self.keys) == 1:
            raise httpx.ReadError("connection reset by peer")
        return response


def test_a_submit_whose_answer_is_lost_is_retried_with_the_same_key_and_creates_one_job(
    service: Service,
) -> None:
    http = AnswerLostOnce(service.client("grace"))
    client = ConveyorClient(http)  # type: ignore[arg-type]

    job = client.submit({"prompt": "only once", "max_tokens": 2})  # no key given: the client makes one

    assert len(http.keys) == 2 and len(set(http.keys)) == 1 and http.keys[0] is not None
    with service.session_factory() as session:
        assert [j.id for j in jobs.page(session, "grace", limit=10)] == [job["id"]]


def test_client_submit_status_wait_cancel(service: Service) -> None:
    client = ConveyorClient(service.client("frank"))
    job = client.submit({"prompt": "hello", "max_tokens": 2}, idempotency_key="c-1")
    assert client.submit({"prompt": "hello", "max_tokens": 2}, idempotency_key="c-1")["id"] == job["id"]
    assert client.get(job["id"])["status"] == "queued"
    with pytest.raises(TimeoutError):
        client.wait(job["id"], timeout_s=0.05)
    with service.session_factory() as s:
        assert jobs.claim(s, job["id"], "w", utcnow()) is not None
        assert jobs.complete(s, job["id"], 1, result_text="hi", finish_reason="stop", prompt_tokens=2,
                             completion_tokens=1, preemptions=0, first_token_at=None, now=utcnow())
    done = client.wait(job["id"], timeout_s=5)
    assert done["status"] == "succeeded" and done["result"]["text"] == "hi"
    with pytest.raises(ClientError, match=r"HTTP 409: id: job .* already succeeded"):
        client.cancel(job["id"])


def test_conveyor_purge_cancels_the_callers_queued_jobs(
    service: Service, prompt_tokenizer: PromptTokenizer
) -> None:
    served, _ = _recording_app(service, prompt_tokenizer, LocalFinishedHub())
    key = new_api_key(service.settings.database_url, "judy")
    client = ConveyorClient(service.client_with_key(key))
    ids = [client.submit({"prompt": "x", "max_tokens": 2})["id"] for _ in range(3)]
    with serving(served) as url:
        result = runner.invoke(app, ["purge", "interactive", "--url", url, "--api-key", key])
        unknown = runner.invoke(app, ["purge", "bulk", "--url", url, "--api-key", key])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == {"queue": "interactive", "cancelled": 3, "tenant": "judy"}
    assert {client.get(job_id)["status"] for job_id in ids} == {"cancelled"}
    assert unknown.exit_code != 0 and "no served model has a queue 'bulk'" in unknown.output


def test_conveyor_wait_long_polls_until_the_job_finishes_and_prints_it(
    service: Service, prompt_tokenizer: PromptTokenizer
) -> None:
    hub = LocalFinishedHub()
    served, queries = _recording_app(service, prompt_tokenizer, hub)
    key = new_api_key(service.settings.database_url, "heidi")
    job = ConveyorClient(service.client_with_key(key)).submit({"prompt": "x", "max_tokens": 2})

    def finish() -> None:
        time.sleep(0.5)
        with service.session_factory() as s:
            assert jobs.claim(s, job["id"], "w", utcnow()) is not None
            assert jobs.complete(s, job["id"], 1, result_text="hi", finish_reason="stop", prompt_tokens=2,
                                 completion_tokens=1, preemptions=0, first_token_at=None, now=utcnow())
        hub.finished([job["id"]])

    worker = threading.Thread(target=finish)
    with serving(served) as url:
        worker.start()
        result = runner.invoke(app, ["wait", job["id"], "--url", url, "--api-key", key])
    worker.join()
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["status"] == "succeeded"
    assert queries == ["wait=30.000"]  # one long poll, answered when the job finished


def test_conveyor_wait_gives_up_after_its_timeout(
    service: Service, prompt_tokenizer: PromptTokenizer
) -> None:
    served, queries = _recording_app(service, prompt_tokenizer, LocalFinishedHub())
    key = new_api_key(service.settings.database_url, "ivan")
    job = ConveyorClient(service.client_with_key(key)).submit({"prompt": "x", "max_tokens": 2})
    with serving(served) as url:
        started = time.monotonic()
        result = runner.invoke(app, ["wait", job["id"], "--url", url, "--api-key", key, "--timeout", "0.5"])
    assert result.exit_code == 2 and "still queued after 0.5 s" in result.output
    assert time.monotonic() - started < 5
    assert queries and all(0 < float(q.removeprefix("wait=")) <= 0.5 for q in queries), queries


def _recording_app(
    service: Service, tokenizer: PromptTokenizer, hub: LocalFinishedHub
) -> tuple[FastAPI, list[str]]:
    """The service's app with the in-process hub, recording the query string of each job read."""
    served = create_app(service.settings, publisher=RecordingPublisher(), tokenizer=tokenizer,
                        finished_watch=hub, finished_sink=hub)
    queries: list[str] = []

    @served.middleware("http")
    async def record(request: Request, call_next: Any) -> Any:
        if request.method == "GET" and request.url.path.startswith("/v1/jobs/"):
            queries.append(request.url.query)
        return await call_next(request)

    return served, queries


def test_serve_runs_every_model_of_the_registry(tmp_path: Path, tiny_model_dir: Callable[..., Path]) -> None:
    """`conveyor serve --config` with two models: one process, an engine each, every job run by its model."""
    config = tmp_path / "models.toml"
    qwen = tiny_model_dir("Qwen2ForCausalLM", vocab_size=640, seed=7)
    config.write_text('num_threads = 1\ndtype = "float32"\nnum_kv_blocks = 128\n'
                      f'[models.llama]\npath = "{tiny_model_dir("LlamaForCausalLM")}"\n'
                      f'[models.qwen]\npath = "{qwen}"\nnum_kv_blocks = 64\n')  # qwen's own
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(CONVEYOR_DATA_DIR=str(tmp_path), PYTHONPATH=str(REPO_ROOT))
    command = [sys.executable, "-m", "conveyor", "serve", "--port", str(port), "--config", str(config)]
    proc = subprocess.Popen(command, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(f"{url}/healthz"), "conveyor serve to start", timeout_s=180)
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["llama", "qwen"]
        ids = {model: httpx.post(f"{url}/v1/jobs", json={"model": model, "prompt": "Hello", "max_tokens": 3},
                                 timeout=30).json()["id"] for model in ("llama", "qwen")}
        done = {model: httpx.get(f"{url}/v1/jobs/{job_id}", params={"wait": 60}, timeout=90).json()
                for model, job_id in ids.items()}
        assert {model: (job["status"], job["model"]) for model, job in done.items()} == {
            "llama": ("succeeded", "llama"), "qwen": ("succeeded", "qwen")}, done
    finally:
        proc.terminate()
        output = proc.communicate(timeout=60)[0].decode(errors="replace")
    assert "llama (" in output and "qwen (" in output, output  # the start-up line names both


def test_conveyor_submit_run_at_then_retry(service: Service, prompt_tokenizer: PromptTokenizer) -> None:
    served, _ = _recording_app(service, prompt_tokenizer, LocalFinishedHub())
    key = new_api_key(service.settings.database_url, "kim")
    client = ConveyorClient(service.client_with_key(key))
    with serving(served) as url:
        given = ["--url", url, "--api-key", key]
        submitted = runner.invoke(app, ["submit", "later", "--run-at", "2099-01-01T00:00:00Z", *given])
        soon = runner.invoke(app, ["submit", "soon", "--delay", "600", "--max-retries", "1", *given])
        both = runner.invoke(app, ["submit", "x", "--delay", "1", "--run-at", "2099-01-01T00:00:00Z", *given])
        job_id = json.loads(soon.output)["id"]
        client.cancel(job_id)
        retried = runner.invoke(app, ["retry", job_id, *given])
        again = runner.invoke(app, ["retry", job_id, *given])
    assert submitted.exit_code != 0 and "at most 30 days ahead" in submitted.output  # the API's 422
    assert soon.exit_code == 0, soon.output
    assert (json.loads(soon.output)["status"], json.loads(soon.output)["max_retries"]) == ("scheduled", 1)
    assert both.exit_code != 0 and "not both" in both.output
    assert retried.exit_code == 0, retried.output
    job = json.loads(retried.output)
    assert (job["id"], job["status"]) == (job_id, "queued")
    assert [h["status"] for h in job["history"]] == ["cancelled"]
    assert again.exit_code != 0 and "is queued; only a failed, cancelled or expired job" in again.output
