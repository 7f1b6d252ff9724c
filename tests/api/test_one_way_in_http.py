"""One way in: the same bodies go to the job API (POST /v1/jobs), to the OpenAI route of their kind
(/v1/completions or /v1/chat/completions) and, as lines, into a batch through the batch runner, and each
door gives the same verdict: accepted, or refused naming the same field (422 on /v1/jobs, 400 on the OpenAI
routes, a line error whose message starts with the field). The limits are the request rules of core (prompt
bytes and tokens, max_tokens, the model's context, min_tokens) beside the shared schema rules (structured
outputs, sampling fields). The jobs every door stores come from one constructor: a batch's carry their
batch in their batch_id column, a job API's never, even when its metadata says "batch_id"."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.protocol.openai_request import CHAT, COMPLETIONS
from conveyor.core.protocol.request_rules import PROMPT_BYTES_PER_TOKEN
from conveyor.core.store.tables import BatchLine, Job
from conveyor.engine.tokenizer import Tokenizer
from conveyor.worker.batches.runner import BatchRunner
from tests.support.service import CancelOnPublish, Service, error_of

MAX_PROMPT_TOKENS = 40
MAX_OUTPUT_TOKENS = 8
MAX_MODEL_LEN = 44  # a prompt of 37 to 40 tokens fits the queue, but not with 8 tokens of output
BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
LONG_IN_BYTES = "x" * (MAX_PROMPT_TOKENS * PROMPT_BYTES_PER_TOKEN + 1)
LONG_IN_TOKENS = "word " * 30  # 150 bytes: under the byte bound, over 40 tokens
# (case, prompt text, fields beside it, the field every door must refuse; None: every door accepts)
CASES: list[tuple[str, str, dict[str, Any], str | None]] = [
    ("valid", "hello", {"max_tokens": 4}, None),
    ("prompt-bytes", LONG_IN_BYTES, {"max_tokens": 4}, "<prompt>"),
    ("prompt-tokens", LONG_IN_TOKENS, {"max_tokens": 4}, "<prompt>"),
    ("max-tokens", "hello", {"max_tokens": MAX_OUTPUT_TOKENS + 1}, "max_tokens"),
    ("context", "<fills the context>", {"max_tokens": MAX_OUTPUT_TOKENS}, "max_tokens"),
    ("schema", "hello", {"max_tokens": 4, "response_format": BAD_SCHEMA}, "response_format"),
    ("top-p", "hello", {"max_tokens": 4, "top_p": 0}, "top_p"),
    ("temperature", "hello", {"max_tokens": 4, "temperature": -1}, "temperature"),
    ("min-tokens", "hello", {"max_tokens": 3, "min_tokens": 5}, "min_tokens"),
]
PROMPT_FIELD = {COMPLETIONS: "prompt", CHAT: "messages"}


@pytest.fixture(scope="module")
def engine_tokenizer(demo_model_dir: Path) -> Tokenizer:
    return Tokenizer(demo_model_dir)


@pytest.fixture
def service(make_service: Callable[..., Service], session_factory: sessionmaker[Session],
            demo_model_dir: Path) -> Service:
    limits = {"max_prompt_tokens": MAX_PROMPT_TOKENS, "max_output_tokens": MAX_OUTPUT_TOKENS}
    return make_service(publisher=CancelOnPublish(session_factory), model=str(demo_model_dir),
                        max_model_len=MAX_MODEL_LEN, queues={"interactive": limits}, batch_window_jobs=100)


def _count(tokenizer: Tokenizer, endpoint: str, text: str) -> int:
    if endpoint == CHAT:
        return len(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
    return len(tokenizer.encode(text))


def _context_filler(tokenizer: Tokenizer, endpoint: str) -> str:
    """Text of 37 to 40 prompt tokens at `endpoint`: within max_prompt_tokens, beyond the context with 8."""
    for words in range(1, 40):
        text = "word " * words
        if _count(tokenizer, endpoint, text) > MAX_MODEL_LEN - MAX_OUTPUT_TOKENS:
            assert _count(tokenizer, endpoint, text) <= MAX_PROMPT_TOKENS
            return text
    raise AssertionError("no filler found")


def _bodies(tokenizer: Tokenizer, endpoint: str) -> list[dict[str, Any]]:
    bodies = []
    for _, text, fields, _ in CASES:
        if text == "<fills the context>":
            text = _context_filler(tokenizer, endpoint)
        prompt = {"messages": [{"role": "user", "content": text}]} if endpoint == CHAT else {"prompt": text}
        bodies.append({**prompt, **fields})
    return bodies


def _expected(endpoint: str) -> list[str | None]:
    return [PROMPT_FIELD[endpoint] if refused == "<prompt>" else refused for _, _, _, refused in CASES]


def _job_api(client: TestClient, body: dict[str, Any]) -> tuple[str | None, str | None]:
    """(the refused field or None, the accepted job's id)."""
    r = client.post("/v1/jobs", json=body)
    if r.status_code == 202:
        return None, str(r.json()["id"])
    assert r.status_code == 422, r.text
    error = error_of(r)
    assert error["message"].startswith(f"{error['field']}: "), error
    return str(error["field"]), None


def _openai_route(client: TestClient, endpoint: str, body: dict[str, Any]) -> str | None:
    r = client.post(endpoint, json=body)
    if r.status_code == 409:  # accepted, stored, and cancelled the moment it was published (no worker)
        assert r.json()["error"]["code"] == "cancelled", r.text
        return None
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"].startswith(f"{error['param']}: "), error
    return str(error["param"])


def _batch(service: Service, client: TestClient, endpoint: str, bodies: list[dict[str, Any]],
           tokenizer: Tokenizer) -> tuple[str, list[BatchLine]]:
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": endpoint, "body": body})
             for i, body in enumerate(bodies)]
    upload = client.post("/v1/files", files={"file": ("in.jsonl", "\n".join(lines).encode())},
                         data={"purpose": "batch"})
    assert upload.status_code == 200, upload.text
    created = client.post("/v1/batches", json={"input_file_id": upload.json()["id"], "endpoint": endpoint,
                                               "queue": "interactive"})
    assert created.status_code == 200, created.text
    batch_id = str(created.json()["id"])
    runner = BatchRunner(service.session_factory, service.settings, lambda job_id, queue: None, "runner-1",
                         tokenizer=tokenizer, s3=None)
    for _ in range(3):
        runner.run_once()
    with service.session_factory() as session:
        rows = session.scalars(select(BatchLine).where(BatchLine.batch_id == batch_id)
                               .order_by(BatchLine.line)).all()
        session.expunge_all()
    assert len(rows) == len(bodies)
    return batch_id, list(rows)


def _line_verdict(line: BatchLine, refused: str | None) -> str | None:
    if line.status != "failed":
        assert line.job_id is not None
        return None
    assert line.error is not None
    message = str(line.error["message"])
    return refused if refused is not None and message.startswith(f"{refused}: ") else message


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_every_door_gives_a_body_the_same_verdict(service: Service, engine_tokenizer: Tokenizer,
                                                  endpoint: str) -> None:
    client = service.client("alice")
    bodies, expected = _bodies(engine_tokenizer, endpoint), _expected(endpoint)
    batch_id, lines = _batch(service, client, endpoint, bodies, engine_tokenizer)
    for (name, *_), body, refused, line in zip(CASES, bodies, expected, lines, strict=True):
        job_api, job_id = _job_api(client, body)
        assert (name, job_api) == (name, refused)
        assert (name, _openai_route(client, endpoint, body)) == (name, refused)
        assert (name, _line_verdict(line, refused)) == (name, refused), line.error
        if refused is None:
            assert job_id is not None and line.job_id is not None
            _check_accepted(body, service.job(job_id), service.job(line.job_id), batch_id)


def _check_accepted(body: dict[str, Any], api_job: Job, batch_job: Job, batch_id: str) -> None:
    """Both jobs come from the store's one constructor: the same prompt tokens, a real request hash, and the
    batch named in the column of the batch's job only."""
    assert api_job.prompt_tokens == batch_job.prompt_tokens and (api_job.prompt_tokens or 0) > 0
    assert len(batch_job.request_hash) == 64 and batch_job.request_hash != api_job.request_hash
    assert (api_job.batch_id, batch_job.batch_id) == (None, batch_id)
    assert batch_job.meta is not None and batch_job.meta["batch_id"] == batch_id  # the line it answers
    assert batch_job.params["max_tokens"] == api_job.params["max_tokens"] == body["max_tokens"]


def test_a_job_whose_metadata_names_a_batch_is_in_no_batch(service: Service) -> None:
    client = service.client("alice")
    r = client.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 4, "metadata": {"batch_id": "x"}})
    assert r.status_code == 202, r.text
    assert client.get(f"/v1/jobs/{r.json()['id']}").json()["metadata"] == {"batch_id": "x"}
    assert service.job(r.json()["id"]).batch_id is None
