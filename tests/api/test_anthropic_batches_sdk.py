"""Anthropic's Message Batches on Conveyor's batches, driven by the official `anthropic` SDK over real HTTP:
an embedded server (uvicorn on an ephemeral port, the tiny demo model, SQLite, auth on with two tenants)
whose batches keep at most BATCH_WINDOW jobs queued or running, so a long batch is still running when it is
cancelled. Each request is judged by the Messages rules then the chat rules, an invalid one errored alone;
results, cancel, list, delete and the tenant rules as Anthropic defines them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from conveyor.api.app import create_app
from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.core.settings import Settings
from conveyor.core.store import jobs
from conveyor.core.store.database import make_db_engine, make_session_factory
from conveyor.core.store.migrate import upgrade
from tests.support.live_server import WAIT_S, new_api_key, serving, wait_for

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=192, block_size=16, dtype="float32",
              device="cpu", attention_backend="torch")
BATCH_WINDOW = 4  # a batch's jobs queued or running at once
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


@dataclass
class Server:
    url: str
    model: str
    database_url: str
    alice: str  # API keys
    bob: str

    def client(self, key: str | None = None) -> anthropic.Anthropic:
        """Anthropic's client pointed at Conveyor (it sends the key as x-api-key)."""
        key = key or self.alice
        return anthropic.Anthropic(base_url=self.url, api_key=key, max_retries=0, timeout=WAIT_S)

    def conveyor_batch(self, message_batch_id: str) -> dict[str, Any]:
        """The same batch as Conveyor's own /v1/batches shows it (its live counts)."""
        batch_id = "batch_" + message_batch_id.removeprefix("msgbatch_")
        response = httpx.get(f"{self.url}/v1/batches/{batch_id}", headers=self._bearer(), timeout=WAIT_S)
        assert response.status_code == 200, response.text
        return dict(response.json())

    def file_ids(self) -> set[str]:
        response = httpx.get(f"{self.url}/v1/files", headers=self._bearer(), timeout=WAIT_S)
        return {row["id"] for row in response.json()["data"]}

    def job(self, job_id: str) -> Any:
        db_engine = make_db_engine(self.database_url)
        try:
            with make_session_factory(db_engine)() as session:
                return jobs.get(session, job_id)
        finally:
            db_engine.dispose()

    def _bearer(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.alice}"}


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path,
             prompt_tokenizer: PromptTokenizer) -> Iterator[Server]:
    from conveyor.worker.embedded import EmbeddedRuntime

    tmp = tmp_path_factory.mktemp("message-batches")
    url = f"sqlite:///{tmp / 'conveyor.db'}"
    upgrade(url)
    settings = Settings(data_dir=tmp, database_url=url, model=str(demo_model_dir), auth_enabled=True,
                        batch_window_jobs=BATCH_WINDOW, reconcile_interval_s=0.2, dispatch_grace_s=0.5,
                        worker_heartbeat_s=0.2, cancel_poll_s=0.1, **ENGINE)
    runtime = EmbeddedRuntime(settings)
    app = create_app(settings, publisher=runtime.publisher, tokenizer=prompt_tokenizer, runtime=runtime)
    with serving(app) as base:
        yield Server(base, demo_model_dir.name, url, new_api_key(url, "alice"), new_api_key(url, "bob"))


def _params(server: Server, text: str, **extra: Any) -> dict[str, Any]:
    return {"model": server.model, "max_tokens": 8, "messages": [{"role": "user", "content": text}], **extra}


def _create_message(client: anthropic.Anthropic, params: dict[str, Any]) -> Any:
    """POST /v1/messages with `params` as sent (the fields this SDK no longer takes by name as extra_body)."""
    named = {name: params[name] for name in ("model", "max_tokens", "messages")}
    rest = {name: value for name, value in params.items() if name not in named}
    return client.messages.create(**named, extra_body=rest)


def _until_ended(client: anthropic.Anthropic, batch_id: str) -> Any:
    state: dict[str, Any] = {}

    def ended() -> bool:
        state["batch"] = client.messages.batches.retrieve(batch_id)
        return bool(state["batch"].processing_status == "ended")

    wait_for(ended, f"message batch {batch_id} to end")
    return state["batch"]


def test_fifty_requests_two_invalid_end_48_succeeded_2_errored(embedded: Server) -> None:
    client = embedded.client()
    invalid = {
        "image-7": _params(embedded, "x") | {"messages": [{"role": "user", "content": [IMAGE]}]},
        "hot-31": _params(embedded, "x", temperature=3.5),
    }
    requests = [{"custom_id": f"q-{i}", "params": _params(embedded, f"say {i}")} for i in range(50)
                if i not in (7, 31)]
    requests += [{"custom_id": custom_id, "params": params} for custom_id, params in invalid.items()]

    created = client.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    assert created.id.startswith("msgbatch_") and created.type == "message_batch"
    assert created.processing_status == "in_progress" and created.results_url is None
    assert created.request_counts.model_dump() == {"processing": 50, "succeeded": 0, "errored": 0,
                                                   "canceled": 0, "expired": 0}
    assert created.expires_at - created.created_at == timedelta(hours=24)
    assert created.ended_at is None and created.cancel_initiated_at is None and created.archived_at is None

    ended = _until_ended(client, created.id)
    assert ended.request_counts.model_dump() == {"processing": 0, "succeeded": 48, "errored": 2,
                                                 "canceled": 0, "expired": 0}
    assert ended.ended_at is not None and ended.ended_at >= ended.created_at
    assert ended.results_url == f"{embedded.url}/v1/messages/batches/{created.id}/results"

    results = {line.custom_id: line.result for line in client.messages.batches.results(created.id)}
    assert sorted(results) == sorted(r["custom_id"] for r in requests)
    succeeded = {custom_id: r for custom_id, r in results.items() if r.type == "succeeded"}
    assert len(succeeded) == 48 and set(results) - set(succeeded) == set(invalid)
    for result in succeeded.values():
        message = result.message  # type: ignore[union-attr]
        assert message.type == "message" and message.role == "assistant" and message.model == embedded.model
        [block] = message.content
        assert block.type == "text" and block.text
        assert 0 < message.usage.output_tokens <= 8 and message.usage.input_tokens > 0
        job = embedded.job(message.id.removeprefix("msg_"))
        assert job.status == "succeeded" and job.queue.endswith(":documents")
        assert job.result_text == block.text

    # Each invalid request errored as the synchronous route refuses the same params: one set of rules.
    for custom_id, params in invalid.items():
        result = results[custom_id]
        assert result.type == "errored", result
        assert result.error.type == "error" and result.error.error.type == "invalid_request_error"
        with pytest.raises(anthropic.BadRequestError) as refused:
            _create_message(client, params)
        assert result.error.error.message == refused.value.body["error"]["message"]  # type: ignore[index]
    assert "image" in results["image-7"].error.error.message  # type: ignore[union-attr]
    assert "temperature" in results["hot-31"].error.error.message  # type: ignore[union-attr]


def test_a_result_is_the_message_the_synchronous_route_answers(embedded: Server) -> None:
    """Greedy, so the same request gives the same text: with a stop sequence found inside it, the result ends
    just before it and names it, as POST /v1/messages does."""
    client = embedded.client()
    free = _params(embedded, "Write a haiku about queues.", max_tokens=12, temperature=0)
    text = _create_message(client, free).content[0].text
    stop = text[6:9]
    assert len(stop) == 3, text
    stopped = {**free, "stop_sequences": [stop]}
    batch = client.messages.batches.create(requests=[{"custom_id": "free", "params": free},  # type: ignore[list-item]
                                                     {"custom_id": "stopped", "params": stopped}])
    _until_ended(client, batch.id)
    results = {line.custom_id: line.result.message for line in client.messages.batches.results(batch.id)}  # type: ignore[union-attr]
    for custom_id, params in (("free", free), ("stopped", stopped)):
        answered, result = _create_message(client, params), results[custom_id]
        assert [(b.type, b.text) for b in result.content] == [(b.type, b.text) for b in answered.content]
        assert (result.stop_reason, result.stop_sequence) == (answered.stop_reason, answered.stop_sequence)
        assert result.usage.output_tokens == answered.usage.output_tokens
    assert results["stopped"].content[0].text == text[: text.index(stop)]
    assert (results["stopped"].stop_reason, results["stopped"].stop_sequence) == ("stop_sequence", stop)


def test_cancel_ends_the_batch_with_canceled_results_for_what_had_not_run(embedded: Server) -> None:
    client = embedded.client()
    requests = [{"custom_id": f"c-{i}", "params": _params(embedded, f"count to {i}", max_tokens=16)}
                for i in range(200)]
    created = client.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    wait_for(lambda: embedded.conveyor_batch(created.id)["request_counts"]["completed"] >= 2,
             "two requests to succeed")

    # While it runs: no results yet, and it cannot be deleted.
    with pytest.raises(anthropic.AnthropicError, match="results_url"):
        client.messages.batches.results(created.id)
    response = httpx.get(f"{embedded.url}/v1/messages/batches/{created.id}/results",
                         headers={"x-api-key": embedded.alice}, timeout=WAIT_S)
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError, match="has not ended"):
        client.messages.batches.delete(created.id)

    canceling = client.messages.batches.cancel(created.id)
    assert canceling.processing_status in ("canceling", "ended") and canceling.cancel_initiated_at is not None
    ended = _until_ended(client, created.id)
    counts = ended.request_counts
    assert counts.processing == counts.errored == counts.expired == 0
    assert counts.succeeded >= 2 and counts.canceled >= 200 - BATCH_WINDOW - counts.succeeded
    assert counts.succeeded + counts.canceled == 200
    results = {line.custom_id: line.result.type for line in client.messages.batches.results(created.id)}
    assert sorted(results) == sorted(r["custom_id"] for r in requests)
    assert sorted(results.values()) == ["canceled"] * counts.canceled + ["succeeded"] * counts.succeeded
    assert client.messages.batches.cancel(created.id).processing_status == "ended"  # as it is


def test_retrieve_list_in_pages_and_delete(embedded: Server) -> None:
    client = embedded.client()
    made = [client.messages.batches.create(requests=[{"custom_id": "only", "params": _params(embedded, n)}])
            for n in ("one", "two", "three")]
    newest_first = [batch.id for batch in reversed(made)]
    for batch in made:
        _until_ended(client, batch.id)
    assert client.messages.batches.retrieve(made[0].id).id == made[0].id

    first = client.messages.batches.list(limit=2)
    listed = [batch.id for batch in first.data]
    assert listed == newest_first[:2] and first.has_more and first.first_id == listed[0]
    assert first.last_id == listed[1]
    after = client.messages.batches.list(limit=2, after_id=listed[1])
    assert [batch.id for batch in after.data][:1] == newest_first[2:]
    before = client.messages.batches.list(limit=1, before_id=newest_first[2])
    assert [batch.id for batch in before.data] == [newest_first[1]] and before.has_more
    every = [batch.id for batch in client.messages.batches.list(limit=1)]  # the SDK follows the pages
    assert every[:3] == newest_first
    with pytest.raises(anthropic.BadRequestError):
        client.messages.batches.list(after_id=listed[0], before_id=listed[1])

    # Deleting an ended batch takes its requests' file with it; it is gone for every call after.
    batch_file = embedded.conveyor_batch(made[0].id)["input_file_id"]
    assert batch_file in embedded.file_ids()
    deleted = client.messages.batches.delete(made[0].id)
    assert (deleted.id, deleted.type) == (made[0].id, "message_batch_deleted")
    assert batch_file not in embedded.file_ids()
    for call in (client.messages.batches.retrieve, client.messages.batches.delete,
                 client.messages.batches.cancel):
        with pytest.raises(anthropic.NotFoundError):
            call(made[0].id)
    assert made[0].id not in [batch.id for batch in client.messages.batches.list(limit=1000)]


def test_another_tenants_message_batch_is_not_found(embedded: Server) -> None:
    alice, bob = embedded.client(), embedded.client(embedded.bob)
    batch = alice.messages.batches.create(requests=[{"custom_id": "a", "params": _params(embedded, "hi")}])
    _until_ended(alice, batch.id)
    for call in (bob.messages.batches.retrieve, bob.messages.batches.cancel, bob.messages.batches.delete):
        with pytest.raises(anthropic.NotFoundError) as missing:
            call(batch.id)
        assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    response = httpx.get(f"{embedded.url}/v1/messages/batches/{batch.id}/results",
                         headers={"x-api-key": embedded.bob}, timeout=WAIT_S)
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
    assert batch.id not in [b.id for b in bob.messages.batches.list(limit=1000)]
    assert alice.messages.batches.retrieve(batch.id).processing_status == "ended"
    # Bearer works as x-api-key does; no key at all is an authentication_error.
    bearer = anthropic.Anthropic(base_url=embedded.url, auth_token=embedded.alice, max_retries=0)
    assert bearer.messages.batches.retrieve(batch.id).id == batch.id
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=embedded.url, api_key="not-a-key", max_retries=0).messages.batches.list()


@pytest.mark.parametrize(("requests", "named"), [
    ([{"custom_id": c, "params": {}} for c in ("same", "b", "same")],
     "requests[2].custom_id: 'same' is already the custom_id of requests[0]"),
    ([{"custom_id": "has space", "params": {}}], "requests[0].custom_id"),
    ([{"custom_id": "x" * 65, "params": {}}], "requests[0].custom_id"),
    ([{"custom_id": "", "params": {}}], "requests[0].custom_id"),
    ([{"custom_id": "a", "params": "not an object"}], "requests[0].params"),
    ([], "requests"),
    ([{"custom_id": "big", "params": {"system": "x" * (4 << 20)}}], "requests[0].params: "),  # a line's limit
])
def test_a_create_with_bad_custom_ids_is_refused_whole(embedded: Server, requests: list[Any], named: str,
                                                       ) -> None:
    client = embedded.client()
    before = {batch.id for batch in client.messages.batches.list(limit=1000)}
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.batches.create(requests=requests)
    assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert named in refused.value.body["error"]["message"]  # type: ignore[index]
    assert {batch.id for batch in client.messages.batches.list(limit=1000)} == before
