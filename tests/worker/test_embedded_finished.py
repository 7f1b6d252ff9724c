"""`conveyor serve` wiring of the finished-jobs seam: the embedded runtime's hub is the worker's sink and the
API's watch, so a long poll is answered when the engine's job is committed, not at a fallback read."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from conveyor.api import job_waits
from conveyor.api.app import create_app
from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.core.settings import Settings
from conveyor.core.store.migrate import upgrade
from conveyor.worker.embedded import EmbeddedRuntime
from tests.support.service import LOCAL_URL


def test_a_long_poll_is_answered_when_the_embedded_worker_commits_the_job(
    make_settings: Callable[..., Settings], sqlite_url: str, worker_model_dir: Path,
    prompt_tokenizer: PromptTokenizer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(job_waits, "FALLBACK_READ_S", 60.0)  # only a notification answers before the wait
    upgrade(sqlite_url)
    settings = make_settings(database_url=sqlite_url, model=str(worker_model_dir), auth_enabled=False,
                             max_num_seqs=8, num_kv_blocks=512)
    runtime = EmbeddedRuntime(settings)
    app = create_app(settings, publisher=runtime.publisher, tokenizer=prompt_tokenizer, runtime=runtime,
                     token_stream=runtime.token_stream, finished_watch=runtime.finished,
                     finished_sink=runtime.finished)
    with TestClient(app, base_url=LOCAL_URL) as client:
        job = client.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert job.status_code == 202, job.text
        started = time.monotonic()
        done = client.get(f"/v1/jobs/{job.json()['id']}", params={"wait": 50})
        took = time.monotonic() - started
    assert done.status_code == 200 and done.json()["status"] == "succeeded", done.text
    assert took < 40, took
