"""Embedded mode end to end: HTTP -> store -> in-process queue -> engine -> store -> the runtime's webhook
sender thread -> a loopback receiver, on SQLite and Postgres. Nothing here injects time: this checks the
wiring (the sender runs inside the runtime), the other files check the schedule."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text
from standardwebhooks import Webhook

from conveyor.core.settings import Settings
from conveyor.core.store.database import make_db_engine
from tests.support.service import LOCAL_URL
from tests.support.webhook_receiver import Receiver
from tests.support.webhook_service import WEBHOOK_TABLES

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=128, num_kv_blocks=64, block_size=16, dtype="float32",
              device="cpu", attention_backend="torch")
WAIT_S = 120.0   # a hang guard, not a speed assertion


@pytest.fixture
def embedded(database_url: str, make_settings: Callable[..., Settings], demo_model_dir: Path,
             receiver: Receiver) -> Iterator[TestClient]:
    from conveyor.api.app import create_app
    from conveyor.api.prompt_tokenizer import PromptTokenizer
    from conveyor.worker.embedded import EmbeddedRuntime

    _empty(database_url)
    settings = make_settings(database_url=database_url, model=str(demo_model_dir), auth_enabled=False,
                             webhook_allowlist=["127.0.0.1"], **ENGINE)
    runtime = EmbeddedRuntime(settings)
    app = create_app(settings, publisher=runtime.publisher, tokenizer=PromptTokenizer(demo_model_dir),
                     runtime=runtime)
    try:
        with TestClient(app, base_url=LOCAL_URL) as client:
            yield client
    finally:
        _empty(database_url)


def test_a_finished_job_is_delivered_by_the_runtime(embedded: TestClient, receiver: Receiver) -> None:
    secret = embedded.post("/v1/webhooks", json={"url": receiver.url, "events": ["job.*"]}).json()["secret"]
    submitted = embedded.post("/v1/jobs", json={"prompt": "Webhooks tell you when", "max_tokens": 4,
                                                "temperature": 0, "ignore_eos": True})
    assert submitted.status_code == 202, submitted.text
    job_id = submitted.json()["id"]

    deadline = time.monotonic() + WAIT_S
    while not receiver.received and time.monotonic() < deadline:
        time.sleep(0.05)
    [request] = receiver.received
    event = Webhook(secret).verify(request.body, request.headers)
    assert event["type"] == "job.succeeded"
    assert event["data"] == embedded.get(f"/v1/jobs/{job_id}").json()
    assert event["data"]["usage"]["completion_tokens"] == 4
    # the receiver records the request before it answers; the sender records the attempt after
    while time.monotonic() < deadline:
        [delivery] = embedded.get(f"/v1/jobs/{job_id}/deliveries").json()["data"]
        if delivery["status"] != "pending":
            break
        time.sleep(0.05)
    assert delivery["id"] == request.headers["webhook-id"]
    assert delivery["status"] == "delivered"
    assert [a["outcome"] for a in delivery["attempts"]] == ["delivered"]


def _empty(database_url: str) -> None:
    db_engine = make_db_engine(database_url)
    with db_engine.begin() as conn:
        for table in WEBHOOK_TABLES:
            conn.execute(text(f"DELETE FROM {table}"))
    db_engine.dispose()
