"""Every submit-time refusal: its status, its error code and a message naming the field."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from fastapi.testclient import TestClient

from tests.support.service import Service, error_of


def submit(client: TestClient, **body: object) -> tuple[int, dict[str, object]]:
    r = client.post("/v1/jobs", json=body)
    return r.status_code, (error_of(r) if r.status_code >= 400 else r.json())


@pytest.mark.parametrize(("body", "field"), [
    ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "min_p": 2}, "min_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "seed": "abc"}, "seed"),
    ({"prompt": "x", "stop": ""}, "stop"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ({"prompt": "x", "ttl": 0}, "ttl"),
    ({"prompt": "x", "timeout": -5}, "timeout"),
    ({"prompt": "x", "webhook": "not a url"}, "webhook"),
    ({"prompt": "x", "max_token": 5}, "max_token"),  # unknown fields are typos, not ignored
    ({"prompt": "x", "speculate": "no"}, "speculate"),
    ({"prompt": "x", "speculate": 1}, "speculate"),
    ({"prompt": ""}, "prompt"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"prompt": "a\u0000b"}, "prompt"),  # PostgreSQL text cannot store NUL
    ({"messages": [{"role": "user", "content": "\u0000"}]}, "messages[0].content"),
])
def test_out_of_range_parameters_are_422(alice: TestClient, body: dict[str, object], field: str) -> None:
    status, error = submit(alice, **body)
    assert status == 422, error
    assert error["code"] == "invalid_request" and error["field"] == field
    assert str(error["message"]).startswith(f"{field}: ")


def test_prompt_and_messages_are_exclusive(alice: TestClient) -> None:
    message = "prompt: exactly one of `prompt` or `messages` is required"
    both = submit(alice, prompt="x", messages=[{"role": "user", "content": "y"}])
    neither = submit(alice, max_tokens=3)
    for status, error in (both, neither):
        assert status == 422 and error == {"code": "invalid_request", "message": message, "field": "prompt"}


def test_min_tokens_over_max_tokens(alice: TestClient) -> None:
    status, error = submit(alice, prompt="x", max_tokens=2, min_tokens=3)
    assert status == 422
    assert error == {"code": "invalid_request", "message": "min_tokens: 3 exceeds max_tokens (2)",
                     "field": "min_tokens"}


def test_unknown_queue(alice: TestClient) -> None:
    status, error = submit(alice, prompt="x", queue="gpu")
    assert status == 422
    assert error == {"code": "unknown_queue", "field": "queue",
                     "message": "queue: unknown queue 'gpu'; known queues: documents, interactive"}


def test_max_tokens_over_the_queue_cap(make_service: Callable[..., Service]) -> None:
    svc = make_service(queues={"interactive": {"max_output_tokens": 8}})
    client = svc.client("alice")
    assert submit(client, prompt="x", max_tokens=8)[0] == 202
    status, error = submit(client, prompt="x", max_tokens=9)
    assert status == 422
    assert error == {"code": "max_tokens_too_large", "field": "max_tokens",
                     "message": "max_tokens: 9 exceeds the interactive queue's max_output_tokens (8)"}
    assert submit(client, prompt="x", max_tokens=9, queue="documents")[0] == 202  # the other queue's cap


def test_prompt_over_the_queue_cap_counts_tokens(make_service: Callable[..., Service]) -> None:
    svc = make_service(queues={"interactive": {"max_prompt_tokens": 10}})
    client = svc.client("alice")
    # Ten characters of a rare word are more than ten tokens; forty characters of a common word are fewer.
    assert submit(client, prompt="the " * 4)[0] == 202
    status, error = submit(client, prompt="zqxj" * 10)
    assert status == 422 and error["code"] == "prompt_too_long" and error["field"] == "prompt"
    assert str(error["message"]).startswith("prompt: ") and "exceeds the interactive queue's " \
        "max_prompt_tokens (10)" in str(error["message"])
    long_chat = [{"role": "user", "content": "zqxj" * 10}]
    status, error = submit(client, messages=long_chat)
    assert status == 422 and error["code"] == "prompt_too_long" and error["field"] == "messages"


def test_prompt_plus_max_tokens_over_max_model_len(make_service: Callable[..., Service]) -> None:
    client = make_service(max_model_len=20).client("alice")
    status, error = submit(client, prompt="hello", max_tokens=200, queue="documents")
    assert status == 422 and error["code"] == "context_too_long" and error["field"] == "max_tokens"


def test_metadata_size_cap(make_service: Callable[..., Service]) -> None:
    client = make_service(max_metadata_bytes=64).client("alice")
    assert submit(client, prompt="x", metadata={"k": "v" * 40})[0] == 202
    status, error = submit(client, prompt="x", metadata={"k": "v" * 80})
    assert status == 422 and error["code"] == "metadata_too_large" and error["field"] == "metadata"
    assert error["message"] == "metadata: 88 bytes of JSON exceeds 64"


def test_full_queue_is_429_with_retry_after(make_service: Callable[..., Service]) -> None:
    svc = make_service(queues={"documents": {"max_queued": 2}}, retry_after_s=3)
    client = svc.client("alice")
    for _ in range(2):
        assert submit(client, prompt="x", queue="documents")[0] == 202
    r = client.post("/v1/jobs", json={"prompt": "x", "queue": "documents"})
    assert r.status_code == 429 and r.headers["Retry-After"] == "3"
    assert error_of(r) == {"code": "queue_full", "field": "queue",
                           "message": "queue: the documents queue of model demo-model is full (2 queued); "
                                      "retry after 3 s"}
    assert submit(client, prompt="x")[0] == 202  # interactive has its own cap
    client.post(f"/v1/jobs/{client.get('/v1/jobs').json()['data'][-1]['id']}/cancel")
    assert submit(client, prompt="x", queue="documents")[0] == 202  # room again


@pytest.fixture
def small_body_service(make_service: Callable[..., Service]) -> Iterator[TestClient]:
    yield make_service(max_body_bytes=2048).client("alice")


def test_body_over_cap_by_content_length_is_413(small_body_service: TestClient) -> None:
    r = small_body_service.post("/v1/jobs", json={"prompt": "x" * 3000})
    assert r.status_code == 413
    assert error_of(r) == {"code": "body_too_large", "field": "body",
                           "message": "body: request body exceeds 2048 bytes"}


def test_body_over_cap_without_content_length_is_413(small_body_service: TestClient) -> None:
    def chunks() -> Iterator[bytes]:  # a generator body is sent chunked, with no Content-Length
        yield b'{"prompt": "'
        for _ in range(30):
            yield b"y" * 100
        yield b'"}'

    headers = {"Content-Type": "application/json"}
    r = small_body_service.post("/v1/jobs", content=chunks(), headers=headers)
    assert r.status_code == 413 and error_of(r)["code"] == "body_too_large"
    small = small_body_service.post("/v1/jobs", content=iter([b'{"prompt": "ok"}']), headers=headers)
    assert small.status_code == 202, small.text


def test_idempotency_key_too_long(alice: TestClient) -> None:
    r = alice.post("/v1/jobs", json={"prompt": "x"}, headers={"Idempotency-Key": "k" * 256})
    assert r.status_code == 422 and error_of(r)["field"] == "Idempotency-Key"


@pytest.mark.parametrize("body", [b"{not json", b"\x0b\xff6+#5H"], ids=["malformed", "not-utf8"])
def test_a_body_that_is_not_json_is_one_422_naming_the_body(alice: TestClient, body: bytes) -> None:
    r = alice.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422
    error = error_of(r)
    assert error["code"] == "invalid_request" and error["field"] == "body", error
