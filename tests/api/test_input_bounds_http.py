"""Inputs that used to be stored and then fail (a 500 at insert on PostgreSQL, or a row that breaks every
later read on SQLite), or that failed the engine: each is refused with a 4xx naming the field before anything
is stored, on both backends. Bodies are sent as raw JSON: NaN, Infinity and lone surrogates ("\\udfff") are
what a client can send but Python's own JSON encoder would not produce."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.api.schemas import fields
from conveyor.core.protocol import request_rules
from conveyor.core.protocol.request_rules import MAX_JSON_DEPTH, PROMPT_BYTES_PER_TOKEN
from conveyor.core.store.tables import Batch, Job, Subscription
from tests.support.service import CancelOnPublish, Service, error_of

BIG = 2**70  # the operator's top_k: past every integer column and tensor type
JSON = {"Content-Type": "application/json"}


def post_raw(client: TestClient, path: str, raw: str, **headers: str) -> Any:
    return client.post(path, content=raw.encode("utf-8", "surrogatepass"), headers={**JSON, **headers})


def rows(service: Service, table: Any) -> int:
    with service.session_factory() as session:
        return int(session.execute(select(func.count()).select_from(table)).scalar_one())


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# --- POST /v1/jobs ---------------------------------------------------------------------------------

JOB_REFUSALS = [
    # item 1: every sampling field bounded (int32/int64 where the engine needs it) and finite
    (f'"top_k": {BIG}', "top_k"),
    (f'"top_k": {2**31}', "top_k"),
    (f'"seed": {2**63}', "seed"),
    (f'"seed": {-(2**63) - 1}', "seed"),
    (f'"stop_token_ids": [{2**31}]', "stop_token_ids[0]"),
    (f'"stop_token_ids": {list(range(65))}', "stop_token_ids"),
    (f'"max_tokens": {BIG}', "max_tokens"),
    (f'"min_tokens": {BIG}', "min_tokens"),
    (f'"logprobs": {BIG}', "logprobs"),
    (f'"priority": {2**31}', "priority"),
    ('"priority": 1.5', "priority"),
    ('"deadline_s": 0', "deadline_s"),
    ('"deadline_s": Infinity', "deadline_s"),
    ('"temperature": Infinity', "temperature"),
    ('"temperature": NaN', "temperature"),
    ('"temperature": 1e-9', "temperature"),  # neither greedy nor a temperature the sampler survives
    ('"temperature": 101', "temperature"),
    ('"top_p": NaN', "top_p"),
    ('"min_p": Infinity', "min_p"),
    ('"repetition_penalty": Infinity', "repetition_penalty"),
    ('"repetition_penalty": 0.001', "repetition_penalty"),
    # item 2: ttl and timeout finite and at most a year / 30 days
    ('"ttl": 1e12', "ttl"),
    ('"ttl": Infinity', "ttl"),
    (f'"ttl": {request_rules.MAX_TTL_S + 1}', "ttl"),
    ('"timeout": 1e12', "timeout"),
    ('"timeout": Infinity', "timeout"),
    ('"timeout": NaN', "timeout"),
    # item 2: text and JSON the store can hold and serve back
    ('"stop": "\\udfff"', "stop"),
    ('"stop": ["ok", "\\udfff"]', "stop[1]"),
    ('"stop": "a\\u0000"', "stop"),
    ('"metadata": {"k": "\\udfff"}', "metadata"),
    ('"metadata": {"\\udfff": 1}', "metadata"),
    ('"metadata": {"a": [{"b": "x\\udfffy"}]}', "metadata"),
    ('"metadata": {"k": NaN}', "metadata"),
    ('"metadata": {"a": [1, -Infinity]}', "metadata"),
    ('"metadata": {"k": "a\\u0000"}', "metadata"),
    (f'"metadata": {{"deep": {nested(MAX_JSON_DEPTH + 1)}}}', "metadata"),
    (f'"metadata": {{"deep": {nested(600)}}}', "metadata"),  # deeper than json.dumps can recurse
    ('"webhook": {"url": "https://example.com/h", "note": "\\udfff"}', "webhook"),
    ('"webhook": {"url": "https://example.com/h", "note": NaN}', "webhook"),
]


@pytest.mark.parametrize(("fragment", "field"), JOB_REFUSALS)
def test_job_field_refused_before_anything_is_stored(service: Service, fragment: str, field: str) -> None:
    client = service.client("alice")
    r = post_raw(client, "/v1/jobs", f'{{"prompt": "x", {fragment}}}')
    assert r.status_code == 422, r.text
    error = error_of(r)
    assert error["field"] == field and str(error["message"]).startswith(f"{field}: "), error
    assert rows(service, Job) == 0
    assert client.get("/v1/jobs").status_code == 200


@pytest.mark.parametrize(("body", "field"), [
    ('{"prompt": "\\udfff"}', "prompt"),
    ('{"prompt": "ok \\ud800 then"}', "prompt"),
    ('{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content"),
    ('{"messages": [{"role": "\\udfff", "content": "x"}]}', "messages[0].role"),
    ('{"messages": [{"role": "user", "content": "a\\u0000"}]}', "messages[0].content"),
])
def test_prompt_text_refused(service: Service, body: str, field: str) -> None:
    client = service.client("alice")
    r = post_raw(client, "/v1/jobs", body)
    assert r.status_code == 422 and error_of(r)["field"] == field, r.text
    assert "surrogate" in r.text or "NUL" in r.text
    assert rows(service, Job) == 0


def test_idempotency_key_with_nul_is_refused(service: Service) -> None:
    client = service.client("alice")
    r = client.post("/v1/jobs", json={"prompt": "x"}, headers={"Idempotency-Key": "k\x00"})
    assert r.status_code == 422 and error_of(r)["field"] == "Idempotency-Key"
    assert rows(service, Job) == 0


def test_values_at_the_bounds_are_accepted_and_read_back(alice: TestClient) -> None:
    body = {"prompt": "x", "top_k": 2**31 - 1, "seed": 2**63 - 1, "stop_token_ids": [2**31 - 1] * 64,
            "temperature": 0, "repetition_penalty": fields.MAX_REPETITION_PENALTY,
            "ttl": request_rules.MAX_TTL_S, "timeout": request_rules.MAX_TIMEOUT_S,
            "priority": -(2**31 - 1), "deadline_s": request_rules.MAX_TTL_S,
            "metadata": {"emoji": "\U0001f680", "n": 1.5, "deep": [[[]]]},
            "webhook": {"url": "https://example.com/h", "note": "fine"}}
    r = alice.post("/v1/jobs", json=body)
    assert r.status_code == 202, r.text
    lowest = {"prompt": "y", "seed": -(2**63), "temperature": fields.MIN_TEMPERATURE}
    assert alice.post("/v1/jobs", json=lowest).status_code == 202
    assert alice.get(f"/v1/jobs/{r.json()['id']}").json()["metadata"] == body["metadata"]
    assert len(alice.get("/v1/jobs").json()["data"]) == 2


def test_api_bounds_are_the_engines() -> None:
    """The API cannot import the engine (import-linter); its copies of the bounds must agree."""
    from conveyor.engine import sampling_params as engine
    from conveyor.engine import sequence

    assert (fields.MAX_INT32, fields.MAX_TOP_K) == (engine.MAX_INT32, engine.MAX_TOP_K)
    assert request_rules.MAX_PRIORITY == sequence.MAX_PRIORITY
    assert (fields.MIN_SEED, fields.MAX_SEED) == (engine.MIN_SEED, engine.MAX_SEED)
    assert (fields.MIN_TEMPERATURE, fields.MAX_TEMPERATURE) == (
        engine.MIN_TEMPERATURE, engine.MAX_TEMPERATURE)
    assert (fields.MIN_REPETITION_PENALTY, fields.MAX_REPETITION_PENALTY) == (
        engine.MIN_REPETITION_PENALTY, engine.MAX_REPETITION_PENALTY)


# --- the OpenAI routes: OpenAI's 400 naming the parameter -----------------------------------------

@pytest.fixture
def openai_service(make_service: Callable[..., Service], session_factory: sessionmaker[Session]) -> Service:
    return make_service(publisher=CancelOnPublish(session_factory))


CHAT = '"model": "demo-model", "messages": [{"role": "user", "content": "hi"}]'
MODEL = '"model": "demo-model"'


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", f'{{{CHAT}, "top_k": {BIG}}}', "top_k"),
    ("/v1/chat/completions", f'{{{CHAT}, "seed": {2**64}}}', "seed"),
    ("/v1/chat/completions", f'{{{CHAT}, "max_tokens": {BIG}}}', "max_tokens"),
    ("/v1/chat/completions", f'{{{CHAT}, "temperature": Infinity}}', "temperature"),
    ("/v1/chat/completions", f'{{{CHAT}, "repetition_penalty": NaN}}', "repetition_penalty"),
    ("/v1/chat/completions", f'{{{CHAT}, "presence_penalty": NaN}}', "presence_penalty"),
    ("/v1/chat/completions", f'{{{CHAT}, "stop": ["\\udfff"]}}', "stop[0]"),
    ("/v1/chat/completions", f'{{{MODEL}, "messages": [{{"role": "user", "content": "\\udfff"}}]}}',
     "messages[0].content"),
    ("/v1/chat/completions",
     f'{{{MODEL}, "messages": [{{"role": "user", "content": [{{"type": "text", "text": "a\\u0000"}}]}}]}}',
     "messages[0].content[0].text"),
    ("/v1/chat/completions", '{"model": "\\udfff", "messages": [{"role": "user", "content": "x"}]}', "model"),
    ("/v1/completions", '{"model": "demo-model", "prompt": "\\udfff"}', "prompt"),
    ("/v1/completions", '{"model": "demo-model", "prompt": ["a\\u0000"]}', "prompt[0]"),
    ("/v1/completions", f'{{"model": "demo-model", "prompt": "x", "top_k": {2**31}}}', "top_k"),
])
def test_openai_parameter_refused_before_anything_is_stored(openai_service: Service, path: str, body: str,
                                                            param: str) -> None:
    r = post_raw(openai_service.client("alice"), path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert rows(openai_service, Job) == 0


# --- batches, webhooks, files ----------------------------------------------------------------------

@pytest.mark.parametrize(("fragment", "field"), [
    ('"metadata": {"run": NaN}', "metadata"),
    ('"metadata": {"run": "\\udfff"}', "metadata"),
    ('"metadata": {"run": "a\\u0000"}', "metadata"),
    ('"output": "s3://bucket/out\\u0000/"', "output"),
    ('"output": "s3://bucket/\\udfff/"', "output"),
    ('"webhook": {"url": "https://example.com/h", "x": Infinity}', "webhook"),
])
def test_batch_field_refused_before_anything_is_stored(service: Service, fragment: str, field: str) -> None:
    client = service.client("alice")
    r = post_raw(client, "/v1/batches", f'{{"input": "s3://bucket/in.jsonl", {fragment}}}')
    assert r.status_code == 422 and error_of(r)["field"] == field, r.text
    assert rows(service, Batch) == 0
    assert client.get("/v1/batches").status_code == 200


@pytest.mark.parametrize(("body", "field"), [
    ('{"input": "s3://bucket/in\\u0000.jsonl"}', "input"),
    ('{"input": "s3://bucket/in.jsonl/"}', "input"),
    ('{"input_file_id": "file-\\u0000"}', "input_file_id"),
])
def test_batch_input_refused(service: Service, body: str, field: str) -> None:
    r = post_raw(service.client("alice"), "/v1/batches", body)
    assert r.status_code == 422 and error_of(r)["field"] == field, r.text
    assert rows(service, Batch) == 0


@pytest.mark.parametrize(("body", "field"), [
    ('{"url": "https://hooks.example.com/x", "description": "a\\u0000b"}', "description"),
    ('{"url": "https://hooks.example.com/x", "description": "\\udfff"}', "description"),
    ('{"url": "https://hooks.example.com/\\u0000"}', "url"),
])
def test_webhook_text_refused(service: Service, body: str, field: str) -> None:
    client = service.client("alice")
    r = post_raw(client, "/v1/webhooks", body)
    assert r.status_code == 422 and error_of(r)["field"] == field, r.text
    assert rows(service, Subscription) == 0
    assert client.get("/v1/webhooks").status_code == 200


def test_upload_file_name_is_stored_as_text(alice: TestClient) -> None:
    boundary = "conveyorboundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a\x00b.jsonl\"\r\n"
            f"Content-Type: application/octet-stream\r\n\r\n{{}}\n\r\n--{boundary}--\r\n").encode()
    r = alice.post("/v1/files", content=body,
                   headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert r.status_code == 200 and r.json()["filename"] == "ab.jsonl", r.text
    assert alice.get("/v1/files").status_code == 200


# --- ids that no stored row can have: a 404 (an empty page for `after`), not PostgreSQL's 500 -------

@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/v1/jobs/a%00b"), ("POST", "/v1/jobs/a%00b/cancel"), ("GET", "/v1/jobs/a%00b/deliveries"),
    ("GET", "/v1/batches/a%00b"), ("POST", "/v1/batches/a%00b/cancel"),
    ("GET", "/v1/batches/a%00b/deliveries"),
    ("GET", "/v1/files/a%00b"), ("GET", "/v1/files/a%00b/content"), ("GET", "/v1/webhooks/a%00b"),
    ("DELETE", "/v1/webhooks/a%00b"), ("POST", "/v1/webhooks/a%00b/enable"),
    ("POST", "/v1/webhooks/deliveries/a%00b/resend"),
])
def test_id_with_nul_is_not_found(alice: TestClient, method: str, path: str) -> None:
    r = alice.request(method, path)
    assert r.status_code == 404 and error_of(r)["field"] == "id", r.text


def test_list_cursors_with_nul(alice: TestClient) -> None:
    for path in ("/v1/batches?after=a%00", "/v1/files?after=a%00"):
        r = alice.get(path)
        assert r.status_code == 200 and r.json()["data"] == [], r.text
    import base64

    forged = base64.urlsafe_b64encode(json.dumps(["2026-01-01T00:00:00+00:00", "job_\x00"]).encode()).decode()
    r = alice.get(f"/v1/jobs?cursor={forged}")
    assert r.status_code == 422 and error_of(r)["field"] == "cursor"


# --- item 3: a prompt too large for its queue is refused by its size, before it is tokenized ------

@pytest.fixture
def counted(prompt_tokenizer: PromptTokenizer, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records each tokenizer call."""
    calls: list[str] = []
    for name in ("count_prompt", "count_messages"):
        real = getattr(prompt_tokenizer, name)

        def spy(arg: Any, real: Callable[[Any], int] = real, name: str = name) -> int:
            calls.append(name)
            return real(arg)

        monkeypatch.setattr(prompt_tokenizer, name, spy)
    return calls


def test_megabyte_prompt_is_refused_without_tokenizing(service: Service, counted: list[str]) -> None:
    client = service.client("alice")
    limit = 2048 * PROMPT_BYTES_PER_TOKEN  # the interactive queue's max_prompt_tokens
    r = client.post("/v1/jobs", json={"prompt": "word " * 200_000})
    assert r.status_code == 422, r.text
    assert error_of(r) == {"code": "prompt_too_long", "field": "prompt", "message":
                           f"prompt: 1000000 bytes exceeds the interactive queue's limit of {limit} bytes "
                           f"(max_prompt_tokens 2048 x {PROMPT_BYTES_PER_TOKEN} bytes per token)"}
    chat = client.post("/v1/jobs", json={"messages": [{"role": "user", "content": "é" * 40_000}]})
    assert chat.status_code == 422 and error_of(chat)["field"] == "messages"  # 80,000 bytes of UTF-8
    assert counted == [] and rows(service, Job) == 0
    assert client.post("/v1/jobs", json={"prompt": "x" * 1000}).status_code == 202
    assert counted == ["count_prompt"]


def test_openai_chat_over_the_byte_cap_is_not_tokenized(make_service: Callable[..., Service],
                                                        session_factory: sessionmaker[Session],
                                                        counted: list[str]) -> None:
    # With max_model_len set and no max_tokens, the route counts the prompt to fill in "as many as fit".
    service = make_service(max_model_len=4096, publisher=CancelOnPublish(session_factory))
    body = {"model": "demo-model", "messages": [{"role": "user", "content": "word " * 20_000}]}
    r = service.client("alice").post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert r.json()["error"]["code"] == "prompt_too_long"
    assert counted == [] and rows(service, Job) == 0
