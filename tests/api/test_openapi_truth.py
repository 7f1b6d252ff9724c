"""The OpenAPI document tells the truth: request bodies the schema calls valid are the ones the API accepts
(exactly one of `prompt`/`messages`, of `input`/`input_file_id`; the upload's required parts), and every error
status a route answers is declared for it, with the body shape it really has (Conveyor's or OpenAI's)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from jsonschema import Draft202012Validator
from sqlalchemy.exc import OperationalError

from conveyor.api.app import create_app
from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.core.clock import utcnow
from conveyor.core.protocol.request_rules import MAX_TTL_S
from conveyor.core.settings import Settings
from conveyor.core.store import jobs
from tests.support.service import RecordingPublisher, Service

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory, prompt_tokenizer: PromptTokenizer) -> dict[str, Any]:
    """The OpenAPI document, built once for the module: FastAPI takes half a second of CPU to build it, and
    it does not change with the settings these tests vary (auth, limits, queues:
    test_the_document_does_not_change_with_the_settings)."""
    data = tmp_path_factory.mktemp("openapi")
    settings = Settings(data_dir=data, database_url=f"sqlite:///{data / 'unused.db'}")
    document: dict[str, Any] = create_app(settings, publisher=RecordingPublisher(),
                                          tokenizer=prompt_tokenizer).openapi()
    return document


def test_the_document_does_not_change_with_the_settings(make_service: Callable[..., Service],
                                                       spec: dict[str, Any]) -> None:
    service = make_service(max_body_bytes=2048, queues={"documents": {"max_queued": 1}})  # and auth on
    assert service.http.app.openapi() == spec  # type: ignore[attr-defined]


def validator(spec: dict[str, Any], schema: dict[str, Any]) -> Draft202012Validator:
    """`schema` (typically a $ref into the document's components), able to resolve those refs."""
    return Draft202012Validator({**schema, "components": spec["components"]})


def request_schema(spec: dict[str, Any], path: str) -> Draft202012Validator:
    body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return validator(spec, body)


@pytest.mark.parametrize("body", [
    {"prompt": "x"},
    {"messages": CHAT},
    {"prompt": None, "messages": CHAT},
    {"prompt": "x", "messages": None},
    {"prompt": "x", "messages": CHAT},
    {"prompt": None, "messages": None},
    {"max_tokens": 3},
    {"prompt": ""},
    {"prompt": "a\x00b"},
    {"prompt": "x", "temperature": 0},
    {"prompt": "x", "temperature": 1e-7},
    {"prompt": "x", "top_k": 2**31 - 1},
    {"prompt": "x", "top_k": 2**31},
    {"prompt": "x", "seed": -(2**63)},
    {"prompt": "x", "ttl": MAX_TTL_S},
    {"prompt": "x", "ttl": MAX_TTL_S + 1},
    {"prompt": "x", "stop": ["a"] * 17},
])
def test_job_schema_accepts_what_the_api_accepts(alice: TestClient, spec: dict[str, Any],
                                                 body: dict[str, Any]) -> None:
    valid = request_schema(spec, "/v1/jobs").is_valid(body)
    r = alice.post("/v1/jobs", json=body)
    assert (r.status_code == 202) == valid, (valid, r.text)


@pytest.mark.parametrize(("body", "status"), [
    ({"input": "s3://bucket/in.jsonl"}, 200),
    ({"input_file_id": "file-missing"}, 404),  # valid, but no such upload
    ({"input": None, "input_file_id": "file-missing"}, 404),
    ({"input": "s3://bucket/in.jsonl", "input_file_id": "file-missing"}, 422),
    ({}, 422),
    ({"input": "s3://bucket/prefix/"}, 422),
    ({"input": "s3://bucket/in\u0000.jsonl"}, 422),
    ({"input": "s3://bucket/in.jsonl", "output": "s3://Bucket/out/"}, 422),
])
def test_batch_schema_accepts_what_the_api_accepts(alice: TestClient, spec: dict[str, Any],
                                                   body: dict[str, Any], status: int) -> None:
    valid = request_schema(spec, "/v1/batches").is_valid(body)
    r = alice.post("/v1/batches", json=body)
    assert r.status_code == status, r.text
    assert valid == (status != 422)


def test_upload_form_declares_its_required_parts(alice: TestClient, spec: dict[str, Any]) -> None:
    form = spec["paths"]["/v1/files"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert sorted(form["required"]) == ["file", "purpose"]
    assert form["properties"]["purpose"]["enum"] == ["batch"]
    r = alice.post("/v1/files", files={"file": ("a.jsonl", b"{}\n")})
    assert r.status_code == 422 and r.json()["error"]["field"] == "purpose"


def test_no_fastapi_validation_shape_is_declared(spec: dict[str, Any]) -> None:
    """Validation errors answer Conveyor's (or OpenAI's) shape, never FastAPI's {"detail": [...]}."""
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            if path.startswith("/v1/"):  # the store can be unreachable and a bug can happen anywhere
                assert {"500", "503"} <= set(operation["responses"]), (method, path)
            assert "default" not in operation["responses"], (method, path)  # it would hide every 4xx


Call = Callable[[TestClient, Service], Any]  # (alice's client, the service) -> the response


def _multipart_garbage(c: TestClient, _: Service) -> Any:
    return c.post("/v1/files", content=b"--x\r\nnot a part",
                  headers={"Content-Type": "multipart/form-data; boundary=x"})


def _cancel_expired(c: TestClient, service: Service) -> Any:
    job = c.post("/v1/jobs", json={"prompt": "x", "ttl": 0.001}).json()
    time.sleep(0.01)
    with service.session_factory() as session:
        assert jobs.claim(session, job["id"], "worker-1", utcnow()) is None  # expires it: its ttl passed
    return c.post(f"/v1/jobs/{job['id']}/cancel")


def _replayed(c: TestClient, _: Service) -> Any:
    c.post("/v1/jobs", json={"prompt": "x"}, headers={"Idempotency-Key": "k"})
    return c.post("/v1/jobs", json={"prompt": "x"}, headers={"Idempotency-Key": "k"})


def _conflicting(c: TestClient, _: Service) -> Any:
    c.post("/v1/jobs", json={"prompt": "x"}, headers={"Idempotency-Key": "k"})
    return c.post("/v1/jobs", json={"prompt": "y"}, headers={"Idempotency-Key": "k"})


def _full(c: TestClient, _: Service) -> Any:
    c.post("/v1/jobs", json={"prompt": "x", "queue": "documents"})
    return c.post("/v1/jobs", json={"prompt": "x", "queue": "documents"})


def _message_batch(c: TestClient) -> str:
    """A message batch that stays in progress: the service has no worker."""
    created = c.post("/v1/messages/batches", json={"requests": [{"custom_id": "a", "params": {}}]})
    assert created.status_code == 200, created.text
    return str(created.json()["id"])


MESSAGE_BATCH = "/v1/messages/batches/{message_batch_id}"
MESSAGE_BATCH_ANSWERS: list[tuple[str, str, Call, int]] = [
    ("post", "/v1/messages/batches", lambda c, _: c.post("/v1/messages/batches", json={"requests": []}), 400),
    ("get", "/v1/messages/batches", lambda c, _: c.get("/v1/messages/batches?limit=0"), 400),
    ("get", MESSAGE_BATCH, lambda c, _: c.get("/v1/messages/batches/msgbatch_nope"), 404),
    ("post", MESSAGE_BATCH + "/cancel", lambda c, _: c.post("/v1/messages/batches/batch_nope/cancel"), 404),
    ("delete", MESSAGE_BATCH, lambda c, _: c.delete(f"/v1/messages/batches/{_message_batch(c)}"), 400),
    ("get", MESSAGE_BATCH + "/results",
     lambda c, _: c.get(f"/v1/messages/batches/{_message_batch(c)}/results"), 400),
    ("get", MESSAGE_BATCH + "/results", lambda c, _: c.get("/v1/messages/batches/msgbatch_x/results"), 404),
]
ANSWERS: list[tuple[str, str, Call, int]] = [  # (method, path template, request, status it answers)
    ("post", "/v1/jobs", lambda c, _: c.post("/v1/jobs", json={"prompt": 1}), 422),
    ("post", "/v1/jobs", _replayed, 200),
    ("post", "/v1/jobs", _conflicting, 409),
    ("post", "/v1/jobs", _full, 429),
    ("post", "/v1/jobs", lambda c, _: c.post("/v1/jobs", json={"prompt": "x" * 3000}), 413),
    ("get", "/v1/jobs", lambda c, _: c.get("/v1/jobs?limit=0"), 422),
    ("get", "/v1/jobs/{job_id}", lambda c, _: c.get("/v1/jobs/job_nope"), 404),
    ("post", "/v1/jobs/{job_id}/cancel", _cancel_expired, 409),
    ("post", "/v1/batches", lambda c, _: c.post("/v1/batches", json={"input_file_id": "file-nope"}), 404),
    ("post", "/v1/batches", lambda c, _: c.post("/v1/batches", json={}), 422),
    ("get", "/v1/batches", lambda c, _: c.get("/v1/batches?limit=0"), 422),
    ("get", "/v1/batches/{batch_id}", lambda c, _: c.get("/v1/batches/batch_nope"), 404),
    ("post", "/v1/files", _multipart_garbage, 422),
    ("post", "/v1/files", lambda c, _: c.post("/v1/files", files={"file": ("a", b"")}), 422),
    ("get", "/v1/files/{file_id}", lambda c, _: c.get("/v1/files/file-nope"), 404),
    ("post", "/v1/webhooks", lambda c, _: c.post("/v1/webhooks", json={"url": ""}), 422),
    ("get", "/v1/webhooks/{webhook_id}", lambda c, _: c.get("/v1/webhooks/wh_nope"), 404),
    ("post", "/v1/chat/completions", lambda c, _: c.post("/v1/chat/completions", json={"model": "m"}), 400),
    ("post", "/v1/chat/completions",
     lambda c, _: c.post("/v1/chat/completions", json={"model": "nope", "messages": CHAT}), 404),
    ("post", "/v1/completions",
     lambda c, _: c.post("/v1/completions", json={"model": "m", "prompt": "x" * 3000}), 413),
    ("get", "/v1/models/{model_id}", lambda c, _: c.get("/v1/models/nope"), 404),
    ("post", "/v1/messages", lambda c, _: c.post("/v1/messages", json={"model": "m", "messages": CHAT}), 400),
    ("post", "/v1/messages",
     lambda c, _: c.post("/v1/messages", json={"model": "nope", "messages": CHAT, "max_tokens": 4}), 404),
    ("post", "/v1/messages",
     lambda c, _: c.post("/v1/messages", json={"model": "demo-model", "messages": CHAT, "max_tokens": 65536}),
     400),
    ("post", "/v1/messages/count_tokens",
     lambda c, _: c.post("/v1/messages/count_tokens", json={"model": "m", "messages": [{"role": "tool"}]}),
     400),
    *MESSAGE_BATCH_ANSWERS,
]


@pytest.mark.parametrize(("method", "path", "call", "status"), ANSWERS)
def test_each_answer_is_declared_with_its_shape(make_service: Callable[..., Service], spec: dict[str, Any],
                                                method: str, path: str, call: Call, status: int) -> None:
    service = make_service(max_body_bytes=2048, queues={"documents": {"max_queued": 1}})
    r = call(service.client("alice"), service)
    assert r.status_code == status, r.text
    _assert_declared(spec, method, path, r)


def test_unauthenticated_answers_are_declared(service: Service, spec: dict[str, Any]) -> None:
    for method, path, url in (("get", "/v1/jobs", "/v1/jobs"), ("get", "/v1/models", "/v1/models"),
                              ("get", "/v1/batches/{batch_id}", "/v1/batches/b"),
                              ("post", "/v1/messages", "/v1/messages"),
                              ("get", "/v1/messages/batches", "/v1/messages/batches")):
        r = service.http.request(method.upper(), url)
        assert r.status_code == 401, r.text
        _assert_declared(spec, method, path, r)


def test_openai_routes_answer_a_store_outage_in_openai_shape(service: Service, spec: dict[str, Any],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    def unreachable(*_: Any) -> str:
        raise OperationalError("SELECT 1", {}, ConnectionRefusedError("db-host:5432"))

    monkeypatch.setattr("conveyor.api.auth.tenant_of_key", unreachable)  # behind every route
    r = service.client("alice").get("/v1/models")
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    assert r.json()["error"]["code"] == "store_unavailable" and "db-host" not in r.text
    _assert_declared(spec, "get", "/v1/models", r)


def _assert_declared(spec: dict[str, Any], method: str, path: str, response: Any) -> None:
    declared = spec["paths"][path][method]["responses"]
    status = str(response.status_code)
    assert status in declared, (method, path, status, sorted(declared))
    schema = declared[status]["content"]["application/json"]["schema"]
    errors = [e.message for e in validator(spec, schema).iter_errors(response.json())]
    assert not errors, (method, path, response.status_code, response.json(), errors)
