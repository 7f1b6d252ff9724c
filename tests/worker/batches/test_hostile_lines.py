"""One hostile line fails alone (issue 27). Before, a line holding a deeply nested response_format schema
(RecursionError in jsonschema) or a 5,000-digit max_tokens (ValueError from Python's int limit in json.loads)
escaped the line parser, and the whole batch ended `failed` with `input_unreadable`, total 0."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select

from conveyor.core.clock import utcnow
from conveyor.core.protocol.request_rules import MAX_INT_DIGITS
from conveyor.core.protocol.structured_rules import MAX_STRUCTURED_DEPTH
from conveyor.core.store import tenants, workers
from conveyor.core.store.tables import Batch, BatchLine, Job
from conveyor.worker.batches.lines import BatchRequest, CustomIdSet, LineError, LineLimits, parse_line
from conveyor.worker.batches.runner import BatchRunner
from tests.support.hostile_schemas import nested_items, nested_objects
from tests.support.service import Service


def schema_body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"prompt": "x", "response_format": {"type": "json_schema",
                                              "json_schema": {"name": "s", "schema": schema}}}


def line(custom_id: str, body: dict[str, Any] | str) -> bytes:
    text = body if isinstance(body, str) else json.dumps(body)
    return f'{{"custom_id": "{custom_id}", "body": {text}}}'.encode()


HOSTILE = [  # (line, code, a fragment of its message)
    (line("objects", schema_body(nested_objects(100))), "invalid_parameter",
     f"response_format: the JSON Schema is nested deeper than {MAX_STRUCTURED_DEPTH} levels"),
    (line("items", schema_body(nested_items(150))), "invalid_parameter",
     f"response_format: the JSON Schema is nested deeper than {MAX_STRUCTURED_DEPTH} levels"),
    (line("digits", '{"prompt": "x", "max_tokens": ' + "9" * 5000 + "}"), "invalid_json",
     f"integer of 5000 digits; at most {MAX_INT_DIGITS}"),
    (line("negative", '{"prompt": "x", "seed": -' + "9" * 5000 + "}"), "invalid_json", "5000 digits"),
    (b'{"custom_id": "elsewhere", "body": {"prompt": "x"}, "x": ' + b"1" * 101 + b"}", "invalid_json",
     "101 digits"),
    (line("string", '{"prompt": "x", "max_tokens": "5"}'), "invalid_parameter",
     "max_tokens: Input should be a valid integer"),
    (line("bool", '{"prompt": "x", "max_tokens": true}'), "invalid_parameter",
     "max_tokens: Input should be a valid integer"),
    (line("float", '{"prompt": "x", "max_tokens": 5.0}'), "invalid_parameter",
     "max_tokens: Input should be a valid integer"),
    (line("logprobs", '{"prompt": "x", "logprobs": true}'), "invalid_parameter",
     "logprobs: Input should be a valid integer"),
    (line("schema-type", schema_body({"$schema": []})), "invalid_parameter", "$schema must be a string"),
]


@pytest.mark.parametrize(("raw", "code", "fragment"), HOSTILE)
def test_hostile_line_is_its_own_error(raw: bytes, code: str, fragment: str) -> None:
    parsed = parse_line(3, raw, CustomIdSet(), LineLimits(max_output_tokens=64))
    assert isinstance(parsed, LineError), parsed
    assert (parsed.line, parsed.code) == (3, code) and fragment in parsed.message, parsed


def test_long_but_sane_integers_still_name_their_field() -> None:
    parsed = parse_line(1, line("k", {"prompt": "x", "top_k": 2**70}), CustomIdSet())
    assert isinstance(parsed, LineError) and parsed.code == "invalid_parameter"
    assert parsed.message.startswith("top_k: "), parsed


def _counter_raising(error: Exception) -> Callable[[BatchRequest], int]:
    def count(request: BatchRequest) -> int:
        raise error

    return count


@pytest.mark.parametrize("error", [RuntimeError("template blew up"), TypeError("bad"), RecursionError()])
def test_anything_judging_a_line_raises_is_that_lines_error(error: Exception,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    limits = LineLimits(max_prompt_tokens=100, count_tokens=_counter_raising(error))
    seen = CustomIdSet()
    with caplog.at_level(logging.ERROR, logger="conveyor.worker.batches.lines"):
        parsed = parse_line(5, line("a", {"prompt": "x"}), seen, limits)
    name = type(error).__name__
    assert parsed == LineError(5, "a", "invalid_line", f"the line could not be judged: {name}")
    assert "a" in seen  # the failed line owns its custom_id, as any other invalid line does
    [record] = caplog.records
    assert record.exc_info is not None and name in record.getMessage()


class _Tokenizer:
    """The engine tokenizer's two methods; a prompt or message saying "explode" makes either raise."""

    chat_template = None

    def encode(self, text: str) -> list[int]:
        if "explode" in text:
            raise RuntimeError("tokenizer failure")
        return [1] * len(text.split())

    def apply_chat_template(self, messages: list[dict[str, str]], **template_kwargs: object) -> list[int]:
        if any("explode" in m["content"] for m in messages):
            raise KeyError("a template variable")
        return [1] * sum(len(m["content"].split()) for m in messages)


def _upload(client: Any, content: bytes) -> str:
    r = client.post("/v1/files", files={"file": ("lines.jsonl", content)}, data={"purpose": "batch"})
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def test_hostile_lines_fail_alone_and_the_rest_of_the_batch_is_queued(
    make_service: Callable[..., Service],
) -> None:
    service = make_service(batch_max_line_bytes=1 << 20)
    client = service.client("alice")
    lines = [line("good-1", {"prompt": "hello", "max_tokens": 2}),
             *(raw for raw, _, _ in HOSTILE),
             line("tokenizer", {"prompt": "explode now"}),
             line("template", {"messages": [{"role": "user", "content": "explode"}]}),
             line("good-2", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})]
    r = client.post("/v1/batches", json={"input_file_id": _upload(client, b"\n".join(lines) + b"\n")})
    assert r.status_code == 200, r.text
    batch_id = r.json()["id"]

    runner = BatchRunner(service.session_factory, service.settings, lambda job_id, queue: None, "runner-1",
                         tokenizer=_Tokenizer(), s3=None)
    for _ in range(3):
        runner.run_once()

    batch = client.get(f"/v1/batches/{batch_id}").json()
    assert batch["status"] == "in_progress" and batch["errors"] is None, batch
    assert batch["request_counts"]["total"] == len(lines)
    with service.session_factory() as session:
        codes = {row.line: (row.error or {}).get("code")
                 for row in session.scalars(select(BatchLine).where(BatchLine.batch_id == batch_id))}
        queued = sorted(job.meta["custom_id"] for job in session.scalars(select(Job)) if job.meta)
    want = [None, *(code for _, code, _ in HOSTILE), "invalid_line", "invalid_line", None]
    assert codes == dict(enumerate(want, start=1))
    assert queued == ["good-1", "good-2"]


def test_a_lines_priority_and_deadline_and_the_window_as_its_default_deadline(
    make_service: Callable[..., Service],
) -> None:
    service = make_service()
    client = service.client("alice")
    lines = [line("urgent", {"prompt": "hello", "max_tokens": 2, "priority": -1, "deadline_s": 30}),
             line("plain", {"prompt": "hello", "max_tokens": 2})]
    r = client.post("/v1/batches", json={"input_file_id": _upload(client, b"\n".join(lines) + b"\n")})
    assert r.status_code == 200, r.text
    runner = BatchRunner(service.session_factory, service.settings, lambda job_id, queue: None, "runner-1",
                         tokenizer=_Tokenizer(), s3=None)
    runner.run_once()
    with service.session_factory() as session:
        batch = session.get(Batch, r.json()["id"])
        queued = {job.meta["custom_id"]: job for job in session.scalars(select(Job)) if job.meta}
        assert batch is not None and batch.expires_at is not None
        urgent, plain = queued["urgent"], queued["plain"]
        assert urgent.priority == -1 and urgent.deadline_at == urgent.created_at + timedelta(seconds=30)
        assert plain.priority == 0 and plain.deadline_at is not None
        assert abs((plain.deadline_at - batch.expires_at).total_seconds()) < 1  # what is left of the window


def test_a_line_outside_its_tenants_priorities_fails_alone_and_lines_start_by_their_slack(
    make_service: Callable[..., Service],
) -> None:
    service = make_service(worker_dead_after_s=600.0)  # the pace stays live however slow the machine
    client = service.client("alice")
    with service.session_factory() as session:
        tenants.set_overrides(session, "alice", {"min_priority": -1}, utcnow())
        workers.register(session, "w1", hostname="h", pid=1, queues=["demo-model:documents"], now=utcnow())
        workers.heartbeat(session, "w1", utcnow(), {"step_s": 0.5, "prefill_token_s": 0.0})
    lines = [line("too-urgent", {"prompt": "hello", "max_tokens": 2, "priority": -5}),
             line("priority", {"prompt": "hello", "max_tokens": 20, "service_tier": "priority",
                               "deadline_s": 60})]
    r = client.post("/v1/batches", json={"input_file_id": _upload(client, b"\n".join(lines) + b"\n")})
    assert r.status_code == 200, r.text
    BatchRunner(service.session_factory, service.settings, lambda job_id, queue: None, "runner-1",
                tokenizer=_Tokenizer(), s3=None).run_once()
    with service.session_factory() as session:
        refused = session.scalars(select(BatchLine).where(BatchLine.line == 1)).one()
        [job] = [job for job in session.scalars(select(Job)) if job.meta]
    assert refused.error is not None and refused.error["code"] == "priority_not_permitted"
    assert "priority: -5 is outside" in refused.error["message"] and "[-1, inf]" in refused.error["message"]
    assert (job.priority, job.service_tier) == (-1, "priority")
    assert job.deadline_at is not None and job.start_by == job.deadline_at - timedelta(seconds=20 * 0.5)


def test_a_line_asking_to_be_refused_when_late_fails_alone_saying_why(make_service: Callable[..., Service],
                                                                       ) -> None:
    service = make_service()
    client = service.client("alice")
    body = {"prompt": "hello", "max_tokens": 2, "deadline_s": 60}
    lines = [line(choice, {**body, "on_deadline_miss": choice}) for choice in ("reject", "accept")]
    r = client.post("/v1/batches", json={"input_file_id": _upload(client, b"\n".join(lines) + b"\n")})
    assert r.status_code == 200, r.text
    BatchRunner(service.session_factory, service.settings, lambda job_id, queue: None, "runner-1",
                tokenizer=_Tokenizer(), s3=None).run_once()
    with service.session_factory() as session:
        refused, taken = session.scalars(select(BatchLine).order_by(BatchLine.line)).all()
    assert refused.error is not None and refused.error["code"] == "invalid_parameter", refused.error
    assert "on_deadline_miss: reject is answered at submit" in refused.error["message"]
    assert taken.error is None and taken.job_id is not None
