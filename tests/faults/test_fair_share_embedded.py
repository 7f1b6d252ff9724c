"""Fair share in embedded mode (`conveyor serve`'s runtime: SQLite, the in-process queue, one engine),
through the real app with auth on: two tenants, documents.max_running = 2.

- A submits 60 documents, then B submits 4: every one of B's jobs finishes before A's 20th (by the finished
  timestamps in the store).
- The same with A's work being a 200-line batch, B submitting while the batch's window is queued.
The runtime's feeders are held (a gate around EmbeddedRuntime._feed) until both tenants' work is queued, so
the order is decided by the fair claim alone, not by how fast the submits came. Not a fault test: no
process is killed; it lives here beside the same checks on PostgreSQL and Redis (test_fair_share_live.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from conveyor.api.app import create_app
from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.core.clock import utcnow
from conveyor.core.settings import Settings
from conveyor.core.store import keys
from conveyor.core.store.migrate import upgrade
from conveyor.core.store.tables import Job
from conveyor.worker.embedded import EmbeddedRuntime
from conveyor.worker.services import WorkerServices
from tests.support.live_server import wait_for
from tests.support.service import LOCAL_URL

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=256, block_size=16, dtype="float32",
              device="cpu", attention_backend="torch")
WINDOW = 64  # batch_window_jobs: the batch's lines queued at once


@dataclass
class Embedded:
    clients: dict[str, TestClient]
    sessions: sessionmaker[Session]
    open_gate: Callable[[], None]


@pytest.fixture
def embedded(
    sqlite_url: str, make_settings: Callable[..., Settings], demo_model_dir: Path,
    prompt_tokenizer: PromptTokenizer, monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Embedded]:
    upgrade(sqlite_url)
    settings = make_settings(database_url=sqlite_url, model=str(demo_model_dir),
                             queues={"documents": {"max_running": 2}}, **ENGINE)
    gate = threading.Event()
    feed = EmbeddedRuntime._feed

    def gated_feed(runtime: EmbeddedRuntime, services: WorkerServices, lane: str) -> None:
        gate.wait()
        feed(runtime, services, lane)

    monkeypatch.setattr(EmbeddedRuntime, "_feed", gated_feed)
    runtime = EmbeddedRuntime(settings)
    app = create_app(settings, publisher=runtime.publisher, tokenizer=prompt_tokenizer, runtime=runtime,
                     session_factory=runtime.sessions)
    with TestClient(app, base_url=LOCAL_URL) as http:
        clients = {}
        for tenant in "ab":
            with runtime.sessions() as session:
                key = keys.create_key(session, tenant, utcnow())[1]
            clients[tenant] = TestClient(http.app, base_url=LOCAL_URL,
                                         headers={"Authorization": f"Bearer {key}"})
        try:
            yield Embedded(clients, runtime.sessions, gate.set)
        finally:
            gate.set()  # the feeders must be able to stop


def _document(client: TestClient, i: int) -> str:
    response = client.post("/v1/jobs", json={"prompt": f"Document {i}: the river", "max_tokens": 2,
                                             "temperature": 0, "queue": "documents"})
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def _rows(sessions: sessionmaker[Session], **where: Any) -> list[Job]:
    with sessions() as session:
        query = select(Job).filter_by(**where)
        return list(session.execute(query).scalars())


def _wait_succeeded(sessions: sessionmaker[Session], ids: set[str]) -> None:
    def done() -> bool:
        rows = [job for job in _rows(sessions) if job.id in ids]
        assert all(job.status in ("queued", "running", "succeeded") for job in rows), rows
        return all(job.status == "succeeded" for job in rows)

    wait_for(done, f"{len(ids)} jobs to succeed")


def _a_jobs_done_before_bs_last(sessions: sessionmaker[Session], b_ids: set[str]) -> int:
    finished = _rows(sessions, status="succeeded")
    last_b = max(job.finished_at for job in finished if job.id in b_ids)  # type: ignore[type-var]
    return sum(1 for job in finished if job.tenant_id == "a" and job.finished_at < last_b)  # type: ignore[operator]


def test_b_submitting_after_as_60_documents_finishes_before_as_20th(embedded: Embedded) -> None:
    a_ids = {_document(embedded.clients["a"], i) for i in range(60)}
    b_ids = {_document(embedded.clients["b"], i) for i in range(4)}
    embedded.open_gate()

    _wait_succeeded(embedded.sessions, a_ids | b_ids)

    assert _a_jobs_done_before_bs_last(embedded.sessions, b_ids) < 19
    assert all(job.attempts == 1 for job in _rows(embedded.sessions))


def test_b_finishes_before_the_20th_line_of_as_200_line_batch(embedded: Embedded) -> None:
    a = embedded.clients["a"]
    lines = "".join(f'{{"custom_id": "l{i}", "body": {{"prompt": "Line {i}", "max_tokens": 2}}}}\n'
                    for i in range(200))
    uploaded = a.post("/v1/files", files={"file": ("in.jsonl", lines.encode())}, data={"purpose": "batch"})
    assert uploaded.status_code == 200, uploaded.text
    body = {"input_file_id": uploaded.json()["id"], "endpoint": "/v1/completions"}
    batch = a.post("/v1/batches", json=body)
    assert batch.status_code == 200, batch.text
    wait_for(lambda: len(_rows(embedded.sessions, tenant_id="a")) >= WINDOW, "the batch's first window")
    b_ids = {_document(embedded.clients["b"], i) for i in range(4)}
    embedded.open_gate()

    _wait_succeeded(embedded.sessions, b_ids)

    assert _a_jobs_done_before_bs_last(embedded.sessions, b_ids) < 19
    assert a.post(f"/v1/batches/{batch.json()['id']}/cancel").status_code == 200
