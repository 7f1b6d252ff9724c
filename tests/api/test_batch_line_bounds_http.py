"""Batch input lines follow the rules of POST /v1/jobs: a line the API would refuse fails on its own (with
its line number) and stores no job, while the rest of the batch runs. Before, such a line made the chunk's
insert fail on PostgreSQL (the batch stuck, re-reading the same lines) or stored a job that broke every later
read on SQLite. The batch goes in over HTTP; a batch runner with no engine reads it into queued jobs."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from sqlalchemy import select

from conveyor.core.protocol.request_rules import MAX_STOP_STRINGS, PROMPT_BYTES_PER_TOKEN
from conveyor.core.store.tables import BatchLine, Job
from conveyor.worker.batches.runner import BatchRunner
from tests.support.service import Service

MAX_PROMPT_TOKENS = 8  # the documents queue's, in this test: prompts over 8 x 32 bytes are refused unread


def _line(custom_id: str, body: str) -> str:
    return f'{{"custom_id": "{custom_id}", "body": {body}}}'


LINES = [  # (line, the error code it must get; None: it runs)
    (_line("ok", '{"prompt": "hello", "max_tokens": 2}'), None),
    (_line("top-k", f'{{"prompt": "x", "top_k": {2**70}}}'), "invalid_parameter"),
    (_line("seed", f'{{"prompt": "x", "seed": {2**64}}}'), "invalid_parameter"),
    (_line("temperature", '{"prompt": "x", "temperature": Infinity}'), "invalid_parameter"),
    (_line("penalty", '{"prompt": "x", "repetition_penalty": NaN}'), "invalid_parameter"),
    (_line("stop-ids", f'{{"prompt": "x", "stop_token_ids": [{2**31}]}}'), "invalid_parameter"),
    (_line("prompt", '{"prompt": "\\udfff"}'), "invalid_body"),
    (_line("content", '{"messages": [{"role": "user", "content": "a\\u0000"}]}'), "invalid_body"),
    (_line("stop", '{"prompt": "x", "stop": ["\\udfff"]}'), "invalid_parameter"),
    (_line("stops", json.dumps({"prompt": "x", "stop": ["s"] * (MAX_STOP_STRINGS + 1)})),
     "invalid_parameter"),
    (_line("logprobs", '{"prompt": "x", "logprobs": 21}'), "invalid_parameter"),
    (_line("model", '{"prompt": "x", "model": "\\udfff"}'), "invalid_parameter"),
    (_line("field", '{"prompt": "x", "bad\\u0000name": 1}'), "invalid_parameter"),
    (_line("long", json.dumps({"prompt": "y" * (MAX_PROMPT_TOKENS * PROMPT_BYTES_PER_TOKEN + 1)})),
     "prompt_too_long"),
    ('{"custom_id": "nul\\u0000id", "body": {"prompt": "x"}}', "invalid_custom_id"),
    ('{"custom_id": "\\udfff", "body": {"prompt": "x"}}', "invalid_custom_id"),
    ('{"custom_id": "deep", "body": {"prompt": "x"}, "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
     "invalid_json"),
]


def _upload(client: Any, content: bytes) -> str:
    r = client.post("/v1/files", files={"file": ("lines.jsonl", content)}, data={"purpose": "batch"})
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def test_bad_lines_fail_alone_and_store_no_job(make_service: Callable[..., Service]) -> None:
    service = make_service(queues={"documents": {"max_prompt_tokens": MAX_PROMPT_TOKENS}},
                           batch_max_line_bytes=1 << 20)
    client = service.client("alice")
    content = "".join(line + "\n" for line, _ in LINES).encode("utf-8", "surrogatepass")
    r = client.post("/v1/batches", json={"input_file_id": _upload(client, content),
                                         "endpoint": "/v1/completions"})
    assert r.status_code == 200, r.text
    batch_id = r.json()["id"]

    runner = BatchRunner(service.session_factory, service.settings, lambda job_id, queue: None, "runner-1",
                         tokenizer=None, s3=None)
    for _ in range(3):
        runner.run_once()

    batch = client.get(f"/v1/batches/{batch_id}")
    assert batch.status_code == 200, batch.text
    assert batch.json()["status"] == "in_progress"
    assert batch.json()["request_counts"]["total"] == len(LINES)
    with service.session_factory() as session:
        codes = {line.line: (line.error or {}).get("code") for line in session.scalars(
            select(BatchLine).where(BatchLine.batch_id == batch_id))}
        jobs = session.scalars(select(Job)).all()
    assert codes == {number: code for number, (_, code) in enumerate(LINES, start=1)}
    assert [job.meta["custom_id"] for job in jobs if job.meta] == ["ok"]
    listed = client.get("/v1/jobs")
    assert listed.status_code == 200 and len(listed.json()["data"]) == 1
