"""POST /v1/messages/batches on a worker-less app: its body may be as large as a batch's input (Anthropic's
256 MB, within files_max_bytes) while every other route keeps max_body_bytes; the batch it makes is
Conveyor's batch of endpoint /v1/messages, its requests stored as an input file."""

from __future__ import annotations

import json
from collections.abc import Callable

from conveyor.core.store import blobs, files
from tests.support.service import Service, error_of


def _body(system_chars: int) -> dict[str, object]:
    return {"requests": [{"custom_id": "a", "params": {"system": "x" * system_chars}}]}


def test_the_create_body_is_capped_by_the_batch_input_size_not_max_body_bytes(
        make_service: Callable[..., Service]) -> None:
    service = make_service(max_body_bytes=2048, files_max_bytes=8192)
    alice = service.client("alice")
    assert alice.post("/v1/messages/batches", json=_body(4000)).status_code == 200
    refused = alice.post("/v1/messages/batches", json=_body(9000))
    assert refused.status_code == 413 and "8192 bytes" in error_of(refused)["message"]
    other = alice.post("/v1/jobs", json={"prompt": "x" * 4000})
    assert other.status_code == 413 and "2048 bytes" in error_of(other)["message"]


def test_a_message_batch_is_a_batch_whose_input_file_holds_its_requests(
        make_service: Callable[..., Service]) -> None:
    service = make_service()
    alice = service.client("alice")
    params = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "café"}]}
    created = alice.post("/v1/messages/batches", json={"requests": [{"custom_id": "q-1", "params": params}]})
    assert created.status_code == 200, created.text
    batch_id = "batch_" + created.json()["id"].removeprefix("msgbatch_")
    batch = alice.get(f"/v1/batches/{batch_id}").json()
    assert (batch["endpoint"], batch["queue"], batch["status"]) == ("/v1/messages", "documents", "validating")
    with service.session_factory() as session:
        source = files.get(session, batch["input_file_id"], "alice")
    assert source is not None and source.purpose == files.BATCH
    stored = b"".join(blobs.read_chunks(service.settings, source.url))
    assert stored.endswith(b"\n") and len(stored) == source.bytes
    assert json.loads(stored) == {"custom_id": "q-1", "method": "POST", "url": "/v1/messages", "body": params}
