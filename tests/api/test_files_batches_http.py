"""Files and Batches over HTTP. With the official `openai` SDK against an embedded server (uvicorn on an
ephemeral port, the tiny model, SQLite, auth on): upload, create, retrieve, list, cancel, download the output
and error files; tenants see only their own. Conveyor's S3 form (`input`/`output`) against moto's S3 server on
loopback. Validation, the upload size cap and the 404s on a worker-less app (SQLite and Postgres)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from conveyor.api.app import create_app
from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.core.protocol.structured_rules import MAX_STRUCTURED_DEPTH
from conveyor.core.settings import Settings
from conveyor.core.store.migrate import upgrade
from tests.support.live_server import new_api_key, serving, wait_for
from tests.support.s3_server import moto_server, use_dummy_credentials
from tests.support.service import Service, error_of

ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=256, num_kv_blocks=192, block_size=16, dtype="float32",
              device="cpu", attention_backend="torch")


def _line(custom_id: str, max_tokens: int = 2, url: str = "/v1/chat/completions") -> bytes:
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0}  # model: optional (the served one)
    if url == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": f"say {custom_id}"}]
    else:
        body["prompt"] = f"say {custom_id}"
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}).encode() + b"\n"


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    with moto_server() as url:
        yield url


@pytest.fixture
def s3(moto_url: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Dummy credentials through the standard chain (environment), and a client for the test's own use."""
    import boto3

    use_dummy_credentials(monkeypatch)
    client = boto3.client("s3", endpoint_url=moto_url, region_name="us-east-1")
    client.create_bucket(Bucket="conveyor-batches")
    return client


@pytest.fixture
def embedded(sqlite_url: str, make_settings: Callable[..., Settings], demo_model_dir: Path,
             prompt_tokenizer: PromptTokenizer, moto_url: str, s3: Any) -> Iterator[tuple[str, str, str]]:
    """(base URL, alice's key, bob's key) of an embedded server with auth on."""
    from conveyor.worker.embedded import EmbeddedRuntime

    upgrade(sqlite_url)
    settings = make_settings(database_url=sqlite_url, model=str(demo_model_dir), batch_window_jobs=4,
                             s3_endpoint_url=moto_url, s3_region="us-east-1", **ENGINE)
    runtime = EmbeddedRuntime(settings)
    app = create_app(settings, publisher=runtime.publisher, tokenizer=prompt_tokenizer, runtime=runtime)
    with serving(app) as url:
        yield url, new_api_key(sqlite_url, "alice"), new_api_key(sqlite_url, "bob")


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def _until_closed(client: openai.OpenAI, batch_id: str) -> Any:
    state: dict[str, Any] = {}

    def closed() -> bool:
        state["batch"] = client.batches.retrieve(batch_id)
        return state["batch"].status in ("completed", "failed", "cancelled", "expired")

    wait_for(closed, f"batch {batch_id} to close")
    return state["batch"]


def test_openai_sdk_batch_round_trip(embedded: tuple[str, str, str]) -> None:
    url, alice_key, bob_key = embedded
    alice, bob = _client(url, alice_key), _client(url, bob_key)
    content = b"".join(_line(f"q-{i}") for i in range(12)) + b"not json\n"
    uploaded = alice.files.create(file=("questions.jsonl", content), purpose="batch")
    assert (uploaded.bytes, uploaded.filename, uploaded.purpose) == (len(content), "questions.jsonl", "batch")
    assert alice.files.content(uploaded.id).content == content

    batch = alice.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                 completion_window="24h", metadata={"run": "nightly"})
    assert batch.status == "validating" and batch.input_file_id == uploaded.id
    done = _until_closed(alice, batch.id)

    assert done.status == "completed" and done.metadata == {"run": "nightly"}
    assert done.request_counts is not None
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (13, 12, 1)
    assert done.output_file_id and done.error_file_id
    output = [json.loads(line) for line in alice.files.content(done.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in output) == sorted(f"q-{i}" for i in range(12))
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in output)
    assert output[0]["response"]["body"]["object"] == "chat.completion"
    errors = [json.loads(line) for line in alice.files.content(done.error_file_id).text.splitlines()]
    assert [(e["line"], e["error"]["code"]) for e in errors] == [(13, "invalid_json")]
    assert alice.files.retrieve(done.output_file_id).purpose == "batch_output"
    listed_files = {f.id for f in alice.files.list()}
    assert listed_files == {uploaded.id, done.output_file_id, done.error_file_id}
    assert [f.id for f in alice.files.list(purpose="batch")] == [uploaded.id]
    assert list(bob.files.list()) == []

    listed = alice.batches.list(limit=10)
    assert [b.id for b in listed.data] == [batch.id] and not listed.has_more
    for call in (lambda: bob.batches.retrieve(batch.id), lambda: bob.files.retrieve(uploaded.id),
                 lambda: bob.files.content(done.output_file_id), lambda: bob.batches.cancel(batch.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert bob.batches.list().data == []


def test_openai_sdk_cancel_keeps_partial_outputs(embedded: tuple[str, str, str]) -> None:
    url, alice_key, _ = embedded
    alice = _client(url, alice_key)
    content = b"".join(_line(f"p-{i}", max_tokens=8, url="/v1/completions") for i in range(200))
    uploaded = alice.files.create(file=("prompts.jsonl", content), purpose="batch")
    batch = alice.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                 completion_window="24h")
    wait_for(lambda: (alice.batches.retrieve(batch.id).request_counts or batch.request_counts).completed >= 2,
          "some lines to complete")

    cancelling = alice.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = _until_closed(alice, batch.id)

    assert done.status == "cancelled" and done.cancelled_at is not None
    counts = done.request_counts
    assert counts is not None and counts.total == 200 and 2 <= counts.completed < 200
    output = [json.loads(line) for line in alice.files.content(done.output_file_id or "").text.splitlines()]
    assert len(output) == counts.completed and output[0]["response"]["body"]["object"] == "text_completion"
    errors = [json.loads(line) for line in alice.files.content(done.error_file_id or "").text.splitlines()]
    assert len(errors) == 200 - counts.completed
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert sorted(r["custom_id"] for r in output + errors) == sorted(f"p-{i}" for i in range(200))


def test_s3_form_through_http(embedded: tuple[str, str, str], s3: Any) -> None:
    url, alice_key, _ = embedded
    s3.put_object(Bucket="conveyor-batches", Key="in/a.jsonl",
                  Body=b"".join(_line(f"s-{i}") for i in range(6)) + _line("s-0"))
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {alice_key}"})
    created = http.post("/v1/batches", json={"input": "s3://conveyor-batches/in/a.jsonl",
                                             "output": "s3://conveyor-batches/out/a", "queue": "documents"})
    assert created.status_code == 200, created.text
    batch = created.json()
    assert (batch["input"], batch["output"], batch["queue"]) == ("s3://conveyor-batches/in/a.jsonl",
                                                                 "s3://conveyor-batches/out/a/", "documents")
    done = _until_closed(_client(url, alice_key), batch["id"])

    assert done.status == "completed" and done.output_file_id is None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (7, 6, 1)
    results = s3.get_object(Bucket="conveyor-batches", Key="out/a/results.jsonl")["Body"].read().splitlines()
    assert [json.loads(r)["custom_id"] for r in results] == [f"s-{i}" for i in range(6)] + ["s-0"]
    assert json.loads(results[-1])["error"]["code"] == "duplicate_custom_id"
    manifest = json.loads(s3.get_object(Bucket="conveyor-batches", Key="out/a/manifest.json")["Body"].read())
    assert manifest["request_counts"] == {"total": 7, "completed": 6, "failed": 1, "cancelled": 0}


def _deep_schema_line(custom_id: str, levels: int) -> bytes:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}}
    return json.dumps({"custom_id": custom_id, "body": body}).encode() + b"\n"


def test_hostile_lines_fail_alone_and_the_good_ones_succeed(embedded: tuple[str, str, str]) -> None:
    """Before (issue 27), a line holding a schema nested 100 levels or a 5,000-digit max_tokens raised out of
    the line parser: the batch ended `failed` (input_unreadable, total 0) and no line ran."""
    url, alice_key, _ = embedded
    alice = _client(url, alice_key)
    chat = '"messages": [{"role": "user", "content": "x"}]'
    content = b"".join([
        _line("good-1"),
        _deep_schema_line("deep", 100),
        b'{"custom_id": "digits", "body": {' + chat.encode() + b', "max_tokens": ' + b"9" * 5000 + b"}}\n",
        b'{"custom_id": "string", "body": {' + chat.encode() + b', "max_tokens": "5"}}\n',
        _line("good-2"),
    ])
    uploaded = alice.files.create(file=("hostile.jsonl", content), purpose="batch")
    batch = alice.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                 completion_window="24h")
    done = _until_closed(alice, batch.id)

    assert done.status == "completed" and done.errors is None
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 2, 3)
    output = [json.loads(line) for line in alice.files.content(done.output_file_id or "").text.splitlines()]
    assert sorted(r["custom_id"] for r in output) == ["good-1", "good-2"]
    assert all(r["response"]["status_code"] == 200 for r in output)
    errors = [json.loads(line) for line in alice.files.content(done.error_file_id or "").text.splitlines()]
    assert [(e["line"], e["error"]["code"]) for e in errors] == [
        (2, "invalid_parameter"), (3, "invalid_json"), (4, "invalid_parameter")]
    assert f"nested deeper than {MAX_STRUCTURED_DEPTH} levels" in errors[0]["error"]["message"]
    assert "5000 digits" in errors[1]["error"]["message"]
    assert errors[2]["error"]["message"] == "max_tokens: Input should be a valid integer"


# --- a worker-less app on SQLite and Postgres ---------------------------------------------------------


def _upload(client: Any, content: bytes, purpose: str = "batch") -> Any:
    return client.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": purpose})


def test_upload_bypasses_the_json_cap_but_has_its_own(make_service: Callable[..., Service]) -> None:
    service = make_service(max_body_bytes=1024, files_max_bytes=2 << 20)
    alice = service.client("alice")
    big = b"".join(_line(f"id-{i}") for i in range(6_000))  # > 1 MiB
    assert 1 << 20 < len(big) < 2 << 20
    uploaded = _upload(alice, big)
    assert uploaded.status_code == 200, uploaded.text
    assert uploaded.json()["bytes"] == len(big)
    assert alice.get(f"/v1/files/{uploaded.json()['id']}/content").content == big

    too_big = _upload(alice, big + big)
    assert too_big.status_code == 413 and error_of(too_big)["code"] == "file_too_large"
    streamed = alice.post("/v1/files", content=_chunks(big + big),
                          headers={"Content-Type": "multipart/form-data; boundary=x"})  # no Content-Length
    assert streamed.status_code == 413 and error_of(streamed)["code"] == "file_too_large"
    json_body = alice.post("/v1/batches", content=b"{" + b" " * 2048 + b"}",
                           headers={"Content-Type": "application/json"})
    assert json_body.status_code == 413  # other routes keep the JSON cap


def _chunks(data: bytes) -> Iterator[bytes]:
    yield b"--x\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.jsonl\"\r\n\r\n"
    for start in range(0, len(data), 65536):
        yield data[start:start + 65536]
    yield b"\r\n--x--\r\n"


def test_validation_and_isolation(service: Service) -> None:
    alice, bob = service.client("alice"), service.client("bob")
    assert error_of(_upload(alice, b"{}\n", purpose="fine-tune"))["field"] == "purpose"
    file_id = _upload(alice, _line("a")).json()["id"]
    cases = [
        ({"input_file_id": file_id, "input": "s3://bucket-a/in.jsonl"}, 422, None),
        ({"endpoint": "/v1/chat/completions"}, 422, None),
        ({"input": "s3://bucket-a/"}, 422, "input"),
        ({"input": "https://example.com/x.jsonl"}, 422, "input"),
        ({"input": "s3://bucket-a/in.jsonl", "queue": "nope"}, 422, "queue"),
        ({"input_file_id": file_id, "completion_window": "soon"}, 422, "completion_window"),
        ({"input_file_id": file_id, "endpoint": "/v1/moderations"}, 422, "endpoint"),
    ]
    for body, status, field in cases:
        response = alice.post("/v1/batches", json=body)
        assert response.status_code == status, (body, response.text)
        if field is not None:
            assert error_of(response)["field"] == field, body
    missing = bob.post("/v1/batches", json={"input_file_id": file_id})  # another tenant's file
    assert missing.status_code == 404 and error_of(missing)["field"] == "input_file_id"
    for path in (f"/v1/files/{file_id}", f"/v1/files/{file_id}/content", "/v1/batches/batch_nope"):
        assert bob.get(path).status_code == 404
    assert bob.post("/v1/batches/batch_nope/cancel").status_code == 404


def test_s3_locations_outside_the_allowlist_are_refused(make_service: Callable[..., Service]) -> None:
    service = make_service(batch_s3_allowlist=["s3://shared-in", "team-out/alice/"])
    alice = service.client("alice")
    refused = [
        ({"input": "s3://private/in.jsonl", "output": "s3://team-out/alice/run/"}, "input"),
        ({"input": "s3://shared-in/in.jsonl", "output": "s3://team-out/bob/"}, "output"),
        ({"input": "s3://shared-in/in.jsonl", "output": "s3://team-out/alicex/"}, "output"),  # not a sibling
        ({"input": "s3://shared-in/in.jsonl", "output": "s3://team-out/alice/../bob/"}, "output"),
        ({"input": "s3://shared-in/in.jsonl", "output": "s3://team-out/"}, "output"),
        ({"input": "s3://team-out/bob/in.jsonl"}, "input"),
    ]
    for body, field in refused:
        response = alice.post("/v1/batches", json=body)
        assert response.status_code == 422, (body, response.text)
        error = error_of(response)
        assert (error["field"], error["code"]) == (field, "s3_location_not_allowed"), body
        assert error["message"].startswith(f"{field}: s3://"), error
    accepted = [{"input": "s3://shared-in/deep/in.jsonl", "output": "s3://team-out/alice/run-1/"},
                {"input": "s3://team-out/alice/in.jsonl"}]
    for body in accepted:
        response = alice.post("/v1/batches", json=body)
        assert response.status_code == 200, (body, response.text)
    file_id = _upload(alice, _line("a")).json()["id"]  # uploads live in the operator's store: not checked
    assert alice.post("/v1/batches", json={"input_file_id": file_id}).status_code == 200
    _forget_batches(service)


def test_list_pages_newest_first(service: Service) -> None:
    alice = service.client("pager-" + uuid.uuid4().hex[:8])  # the Postgres database outlives one test
    ids = [alice.post("/v1/batches", json={"input": f"s3://bucket-a/{i}.jsonl"}).json()["id"]
           for i in range(5)]
    first = alice.get("/v1/batches", params={"limit": 2}).json()
    assert first["object"] == "list" and first["has_more"] is True
    assert [b["id"] for b in first["data"]] == ids[::-1][:2] and first["last_id"] == ids[3]
    rest = alice.get("/v1/batches", params={"limit": 10, "after": first["last_id"]}).json()
    assert [b["id"] for b in rest["data"]] == ids[::-1][2:] and rest["has_more"] is False
    cancelled = alice.post(f"/v1/batches/{ids[0]}/cancel").json()
    assert cancelled["status"] == "cancelling" and cancelled["cancelling_at"] is not None
    _forget_batches(service)


def _forget_batches(service: Service) -> None:
    """These batches name buckets that do not exist: keep them away from later tests' batch runners."""
    from sqlalchemy import delete

    from conveyor.core.store.tables import Batch

    with service.session_factory() as session:
        session.execute(delete(Batch))
        session.commit()


def test_uploads_go_to_s3_when_files_url_is_set(make_service: Callable[..., Service], moto_url: str,
                                                s3: Any) -> None:
    service = make_service(files_url="s3://conveyor-batches/uploads", s3_endpoint_url=moto_url,
                           s3_region="us-east-1")
    alice = service.client("alice")
    content = b"".join(_line(f"u-{i}") for i in range(3))
    uploaded = _upload(alice, content).json()
    stored = s3.get_object(Bucket="conveyor-batches", Key=f"uploads/{uploaded['id']}")["Body"].read()
    assert stored == content
    assert alice.get(f"/v1/files/{uploaded['id']}/content").content == content
