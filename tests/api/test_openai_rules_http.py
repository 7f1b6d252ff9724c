"""One set of rules for OpenAI fields: each body of the table goes to the synchronous route and, as a line,
into a batch of the same endpoint; both accept it or both refuse it naming the same field (400/404 on the
route, a line error with its line number in the batch while the other lines run). Also: bodies that are not
JSON, or not an object, get an error saying so on every route family, in that family's error shape.

The synchronous route's jobs are run to success the moment they are published (no engine); the batch is read
by a batch runner with the demo model's tokenizer (the chat template the API also reads), into queued jobs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.clock import utcnow
from conveyor.core.protocol.openai_request import CHAT, COMPLETIONS
from conveyor.core.store import jobs
from conveyor.core.store.tables import BatchLine
from conveyor.engine.tokenizer import Tokenizer
from conveyor.worker.batches.runner import BatchRunner
from tests.support.service import RecordingPublisher, Service, error_of

USER = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}}
NAMED = {"type": "function", "function": {"name": "add"}}
CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]}
# (case, endpoint, body without model, the field both paths must refuse; None: both accept)
CASES: list[tuple[str, str, dict[str, Any], str | None]] = [
    ("chat", CHAT, {"messages": [USER], "max_tokens": 2}, None),
    ("text", COMPLETIONS, {"prompt": "hi", "max_tokens": 2}, None),
    ("penalties", CHAT, {"messages": [USER], "presence_penalty": 0.5, "frequency_penalty": -1.5}, None),
    ("text-penalties", COMPLETIONS, {"prompt": "hi", "presence_penalty": 2, "frequency_penalty": 2}, None),
    ("presence-range", CHAT, {"messages": [USER], "presence_penalty": 2.5}, "presence_penalty"),
    ("frequency-type", COMPLETIONS, {"prompt": "hi", "frequency_penalty": "high"}, "frequency_penalty"),
    ("n-1", CHAT, {"messages": [USER], "n": 1}, None),
    ("n-2", CHAT, {"messages": [USER], "n": 2}, None),
    ("text-n-2", COMPLETIONS, {"prompt": "hi", "n": 2}, None),
    ("n-too-many", CHAT, {"messages": [USER], "n": 17}, "n"),
    ("priority", CHAT, {"messages": [USER], "priority": -3, "deadline_s": 30}, None),
    ("priority-float", COMPLETIONS, {"prompt": "hi", "priority": 0.5}, "priority"),
    ("deadline-zero", CHAT, {"messages": [USER], "deadline_s": 0}, "deadline_s"),
    ("service-tier", COMPLETIONS, {"prompt": "hi", "service_tier": "flex"}, None),
    ("service-tier-unknown", CHAT, {"messages": [USER], "service_tier": "scale"}, "service_tier"),
    ("unknown-model", CHAT, {"messages": [USER], "model": "gpt-4o"}, "model"),
    ("text-unknown-model", COMPLETIONS, {"prompt": "hi", "model": "gpt-4o"}, "model"),
    ("unknown-role", CHAT, {"messages": [USER, {"role": "robot", "content": "x"}]}, "messages[1].role"),
    ("tool-role", CHAT, {"messages": [USER, {"role": "tool", "content": "4", "tool_call_id": "c"}]}, None),
    ("tools-auto", CHAT, {"messages": [USER], "tools": [TOOL]}, None),
    ("tools-required", CHAT, {"messages": [USER], "tools": [TOOL], "tool_choice": "required",
                              "parallel_tool_calls": False}, None),
    ("tools-named", CHAT, {"messages": [USER], "tools": [TOOL], "tool_choice": NAMED}, None),
    ("tool-choice-alone", CHAT, {"messages": [USER], "tool_choice": "required"}, "tool_choice"),
    ("tool-choice-unknown", CHAT, {"messages": [USER], "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ("tools-twice", CHAT, {"messages": [USER], "tools": [TOOL, TOOL]}, "tools[1].function.name"),
    ("tool-bad-schema", CHAT, {"messages": [USER], "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "nope"}}}]}, "tools[0].function.parameters"),
    ("tool-bad-name", CHAT, {"messages": [USER], "tools": [{"type": "function", "function": {
        "name": "no spaces"}}]}, "tools[0].function.name"),
    ("required-and-format", CHAT, {"messages": [USER], "tools": [TOOL], "tool_choice": "required",
                                   "response_format": {"type": "json_object"}}, "response_format"),
    ("auto-and-format", CHAT, {"messages": [USER], "tools": [TOOL],
                               "response_format": {"type": "json_object"}}, None),
    ("tool-call-history", CHAT, {"messages": [USER, CALLED, {"role": "tool", "content": "4",
                                                             "tool_call_id": "call_1"}]}, None),
    ("tool-call-bad-arguments", CHAT, {"messages": [USER, {**CALLED, "tool_calls": [
        {**CALLED["tool_calls"][0], "function": {"name": "add", "arguments": "[1]"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ("tool-call-from-user", CHAT, {"messages": [{**CALLED, "role": "user"}]}, "messages[0].tool_calls"),
    ("no-content", CHAT, {"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ("continue-final", CHAT, {"messages": [USER, {"role": "assistant", "content": "Sure,"}],
                              "continue_final_message": True}, None),
    ("continue-and-generation", CHAT, {"messages": [USER], "continue_final_message": True,
                                       "add_generation_prompt": True}, "continue_final_message"),
    ("template-kwargs", CHAT, {"messages": [USER], "chat_template_kwargs": {"enable_thinking": False}}, None),
    ("template-kwargs-reserved", CHAT, {"messages": [USER], "chat_template_kwargs": {"tools": []}},
     "chat_template_kwargs"),
    ("text-tools", COMPLETIONS, {"prompt": "hi", "tools": [TOOL]}, "tools"),
    ("developer-role", CHAT, {"messages": [{"role": "developer", "content": "be brief"}, USER]}, None),
    ("unknown-field", CHAT, {"messages": [USER], "frobnicate": 1}, "frobnicate"),
    ("logit-bias", CHAT, {"messages": [USER], "logit_bias": {"5": 1}}, "logit_bias"),
    ("engine-extras", CHAT, {"messages": [USER], "top_k": 5, "stop_token_ids": [2], "min_tokens": 1}, None),
    ("token-ids", COMPLETIONS, {"prompt": [1, 2, 3]}, None),
    ("token-id-lists", COMPLETIONS, {"prompt": [[1, 2], [3]], "n": 2}, None),
    ("several-texts", COMPLETIONS, {"prompt": ["a", "b"]}, None),
    ("token-id-not-in-vocabulary", COMPLETIONS, {"prompt": [[1, 2], [3, 100_000]]}, "prompt[1][1]"),
    ("one-prompt-not-in-vocabulary", COMPLETIONS, {"prompt": [7, 100_000]}, "prompt[1]"),
    ("texts-and-token-ids", COMPLETIONS, {"prompt": ["a", [1]]}, "prompt[1]"),
    ("empty-token-ids", COMPLETIONS, {"prompt": [[1], []]}, "prompt[1]"),
    ("too-many-choices", COMPLETIONS, {"prompt": ["a"] * 129, "n": 16}, "n"),
    ("two-structured", CHAT, {"messages": [USER], "regex": "a+", "choice": ["a"]}, "choice"),
    ("vllm-structured", CHAT, {"messages": [USER], "structured_outputs": {"choice": ["a", "b"]}}, None),
    ("vllm-guided", COMPLETIONS, {"prompt": "hi", "guided_regex": "a+"}, None),
    ("vllm-grammar", CHAT, {"messages": [USER], "structured_outputs": {"grammar": "x"}},
     "structured_outputs"),
    ("vllm-and-openai", CHAT, {"messages": [USER], "regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ("vllm-bad-schema", CHAT, {"messages": [USER], "guided_json": {"type": "nope"}}, "guided_json"),
    ("vllm-text", CHAT,
     {"messages": [USER], "skip_special_tokens": False, "include_stop_str_in_output": True}, None),
    ("vllm-text-not-bool", COMPLETIONS, {"prompt": "hi", "include_stop_str_in_output": "yes"},
     "include_stop_str_in_output"),
    ("speculate-off", CHAT, {"messages": [USER], "speculate": False}, None),
    ("speculate-not-bool", COMPLETIONS, {"prompt": "hi", "speculate": "no"}, "speculate"),
    ("continuous-usage", CHAT, {"messages": [USER], "stream_options": {"continuous_usage_stats": True}},
     "stream_options"),
    (
        "disagree",
        CHAT,
        {"messages": [USER], "max_tokens": 2, "max_completion_tokens": 3},
        "max_completion_tokens",
    ),
    ("top-logprobs", CHAT, {"messages": [USER], "top_logprobs": 2}, "top_logprobs"),
    ("chat-int-logprobs", CHAT, {"messages": [USER], "logprobs": 2}, "logprobs"),
    ("best-of", COMPLETIONS, {"prompt": "hi", "best_of": 2}, "best_of"),
    ("temperature", CHAT, {"messages": [USER], "temperature": 3}, "temperature"),
]


class InstantWorker(RecordingPublisher):
    """Runs each job to success when it is published, so the synchronous routes answer without an engine."""

    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        super().__init__()
        self._session_factory = session_factory

    def publish(self, job_id: str, queue: str) -> None:
        super().publish(job_id, queue)
        with self._session_factory() as session:
            job = jobs.claim(session, job_id, "instant-worker", utcnow())
            assert job is not None
            jobs.complete(
                session,
                job_id,
                job.attempts,
                result_text="ok",
                finish_reason="stop",
                prompt_tokens=1,
                completion_tokens=1,
                preemptions=0,
                first_token_at=None,
                now=utcnow(),
            )


@pytest.fixture(scope="module")
def engine_tokenizer(demo_model_dir: Path) -> Tokenizer:
    return Tokenizer(demo_model_dir)


def _with_model(body: dict[str, Any], model: str) -> dict[str, Any]:
    return {"model": model, **body}


def _sync(client: TestClient, endpoint: str, body: dict[str, Any]) -> tuple[str | None, Any]:
    """(the refused param or None, the response)."""
    r = client.post(endpoint, json=body)
    if r.status_code == 200:
        return None, r
    assert r.status_code in (400, 404), r.text
    error = error_of(r)
    assert error["message"].startswith(f"{error['param']}: "), error
    return str(error["param"]), r


def _run_batch(
    service: Service, client: TestClient, endpoint: str, bodies: list[dict[str, Any]], tokenizer: Tokenizer
) -> dict[int, BatchLine]:
    lines = [
        json.dumps({"custom_id": f"c{i}", "method": "POST", "url": endpoint, "body": body})
        for i, body in enumerate(bodies)
    ]
    upload = client.post(
        "/v1/files", files={"file": ("in.jsonl", "\n".join(lines).encode())}, data={"purpose": "batch"}
    )
    assert upload.status_code == 200, upload.text
    created = client.post("/v1/batches", json={"input_file_id": upload.json()["id"], "endpoint": endpoint})
    assert created.status_code == 200, created.text
    runner = BatchRunner(
        service.session_factory,
        service.settings,
        lambda job_id, queue: None,
        "runner-1",
        tokenizer=tokenizer,
        s3=None,
    )
    for _ in range(3):
        runner.run_once()
    with service.session_factory() as session:
        rows = session.scalars(select(BatchLine).where(BatchLine.batch_id == created.json()["id"])).all()
        session.expunge_all()
    return {row.line: row for row in rows}


def test_a_body_is_accepted_or_refused_alike_by_the_route_and_in_a_batch(
    make_service: Callable[..., Service],
    session_factory: sessionmaker[Session],
    demo_model_dir: Path,
    engine_tokenizer: Tokenizer,
) -> None:
    service = make_service(
        publisher=InstantWorker(session_factory), model=str(demo_model_dir), batch_window_jobs=100
    )
    client = service.client("alice")
    model = service.settings.served_model_id()
    for endpoint in (CHAT, COMPLETIONS):
        cases = [case for case in CASES if case[1] == endpoint]
        bodies = [body if "model" in body else _with_model(body, model) for _, _, body, _ in cases]
        batch = _run_batch(service, client, endpoint, bodies, engine_tokenizer)
        for number, ((name, _, _, refused), body) in enumerate(zip(cases, bodies, strict=True), start=1):
            param, response = _sync(client, endpoint, body)
            line = batch[number]
            assert param == refused, (name, response.text)
            if refused is None:
                assert line.status != "failed" and line.job_id is not None, (name, line.error)
                _check_accepted(service, name, response.headers["X-Conveyor-Job-Id"], line.job_id)
                continue
            assert line.status == "failed" and line.error is not None, name
            assert line.error["message"].startswith(f"{refused}: "), (name, line.error)
            if refused == "model":  # a 404 on the route, its own line error code in the batch
                assert response.status_code == 404 and error_of(response)["code"] == "model_not_found"
                assert line.error["code"] == "model_not_found"


def _check_accepted(service: Service, name: str, sync_job_id: str, batch_job_id: str) -> None:
    """Both paths stored the request alike: the penalties in the params, developer as system."""
    sync_job, batch_job = service.job(sync_job_id), service.job(batch_job_id)
    if name == "penalties":
        for job in (sync_job, batch_job):
            assert (job.params["presence_penalty"], job.params["frequency_penalty"]) == (0.5, -1.5)
    if name == "developer-role":
        for job in (sync_job, batch_job):
            assert job.messages is not None and job.messages[0] == {"role": "system", "content": "be brief"}
    if name == "token-id-lists":  # token ids or several prompts: the job's inputs, its prompt unset
        for job in (sync_job, batch_job):
            assert (job.prompt, job.inputs, job.params["n"]) == (None, [[1, 2], [3]], 2)


BAD_BODIES = [  # (raw body, content type, what the message must say)
    (b"{not json", "application/json", "body: not valid JSON (Expecting property name"),
    (b"", "application/json", "body: empty; send a JSON object"),
    (b"[1, 2]", "application/json", "body: must be a JSON object, got an array"),
    (b'"text"', "application/json", "body: must be a JSON object, got a string"),
    (b"42", "application/json", "body: must be a JSON object, got a number"),
    (b'{"prompt": "x"}', "text/plain", "body: not read as JSON (Content-Type text/plain)"),
]
CONVEYOR_ROUTES = ("/v1/jobs", "/v1/webhooks", "/v1/batches")
OPENAI_ROUTES = (CHAT, COMPLETIONS)


@pytest.mark.parametrize(("raw", "content_type", "says"), BAD_BODIES)
def test_a_body_that_is_not_a_json_object_is_refused_saying_so(
    service: Service,
    raw: bytes,
    content_type: str,
    says: str,
) -> None:
    client = service.client("alice")
    for path in CONVEYOR_ROUTES:
        r = client.post(path, content=raw, headers={"Content-Type": content_type})
        assert r.status_code == 422, (path, r.text)
        error = error_of(r)
        assert (error["code"], error["field"]) == ("invalid_request", "body"), (path, error)
        assert error["message"].startswith(says), (path, error)
    for path in OPENAI_ROUTES:
        r = client.post(path, content=raw, headers={"Content-Type": content_type})
        assert r.status_code == 400, (path, r.text)
        error = error_of(r)
        assert (error["type"], error["param"]) == ("invalid_request_error", "body"), (path, error)
        assert error["message"].startswith(says), (path, error)


def test_the_job_api_takes_the_penalties_and_refuses_unknown_roles(service: Service) -> None:
    client = service.client("alice")
    body = {"prompt": "hi", "presence_penalty": 1.5, "frequency_penalty": -0.5}
    accepted = client.post("/v1/jobs", json=body)
    assert accepted.status_code == 202, accepted.text
    params = service.job(accepted.json()["id"]).params
    assert (params["presence_penalty"], params["frequency_penalty"]) == (1.5, -0.5)
    plain = client.post("/v1/jobs", json={"prompt": "hi"})
    assert "presence_penalty" not in service.job(plain.json()["id"]).params  # unset: params as before
    for refused, field in (
        ({"prompt": "hi", "frequency_penalty": 2.5}, "frequency_penalty"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]},
            "messages[1].role",
        ),
    ):
        r = client.post("/v1/jobs", json=refused)
        assert r.status_code == 422, r.text
        assert error_of(r)["field"] == field and error_of(r)["message"].startswith(f"{field}: ")
