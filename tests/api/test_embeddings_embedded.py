"""Embeddings through the whole service, embedded, over real HTTP: a BERT sentence-transformers folder (mean
pooling), a Qwen2 one (last-token pooling) and a generation model behind one API. The official `openai` SDK's
`client.embeddings.create` answers what `SentenceTransformer(folder).encode` computes, in float and base64
alike; an embedding job through /v1/jobs is queued, waited on, shown in OpenAI's shape and delivered to its
webhook; a /v1/embeddings batch through the SDK's Files and Batches calls answers the same vectors, line by
line; every refusal names the field or the item; a request of one kind to a model of the other is a 400 (a
line error in a batch) saying what the model serves."""

from __future__ import annotations

import base64
import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from conveyor.api.app import create_app
from conveyor.cli.api_server import load_tokenizers
from conveyor.core.clock import utcnow
from conveyor.core.settings import Settings
from conveyor.core.store import tenants
from conveyor.core.store.database import make_db_engine, make_session_factory
from conveyor.core.store.migrate import upgrade
from tests.support.embedding_models import build_decoder_st_folder
from tests.support.encoder_models import build_encoder_st_folder
from tests.support.live_server import WAIT_S, new_api_key, serving
from tests.support.openai_batches import run_batch
from tests.support.s3_server import moto_server, use_dummy_credentials
from tests.support.webhook_receiver import Receiver

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=64, block_size=16, dtype="float32",
              device="cpu", attention_backend="torch")
MAX_INPUTS = 6
TEXTS = ["hello", "The queue holds jobs until a worker is free.",
         "Embeddings turn each input into one vector; short and long inputs share a batch."]
TOLERANCE = 1e-4


@dataclass
class Service:
    url: str
    key: str
    folders: dict[str, Path]
    database_url: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.key, max_retries=0, timeout=WAIT_S)

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=self.headers(), timeout=WAIT_S)

    def get(self, path: str, **params: Any) -> httpx.Response:
        return httpx.get(self.url + path, params=params, headers=self.headers(), timeout=WAIT_S)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Callable[..., Path]) -> dict[str, Path]:
    models = tmp_path_factory.mktemp("embedding-models")
    return {"bert": build_encoder_st_folder(models / "bert", arch="bert", pooling="mean", max_seq_length=64),
            "qwen": build_decoder_st_folder(models / "qwen", arch="qwen2", pooling="lasttoken"),
            "llama": tiny_model_dir("LlamaForCausalLM")}


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def s3_url() -> Iterator[str]:
    """moto's S3 server, and the environment's dummy credentials for the service's batch runner (its S3
    client reads them when it is made)."""
    with moto_server() as url, pytest.MonkeyPatch.context() as monkeypatch:
        use_dummy_credentials(monkeypatch)
        yield url


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, folders: dict[str, Path], s3_url: str,
            ) -> Iterator[Service]:
    from conveyor.worker.embedded import EmbeddedRuntime

    tmp = tmp_path_factory.mktemp("embeddings-embedded")
    url = f"sqlite:///{tmp / 'conveyor.db'}"
    upgrade(url)
    registry = {name: {"path": str(path)} for name, path in folders.items()}
    settings = Settings(data_dir=tmp, database_url=url, models=registry, default_model="llama",
                        auth_enabled=True, max_embedding_inputs=MAX_INPUTS, webhook_allowlist=["127.0.0.1"],
                        reconcile_interval_s=0.2, dispatch_grace_s=0.5, worker_heartbeat_s=0.2,
                        cancel_poll_s=0.1, s3_endpoint_url=s3_url, s3_region="us-east-1", **ENGINE)
    runtime = EmbeddedRuntime(settings)
    app = create_app(settings, publisher=runtime.publisher, tokenizer=load_tokenizers(settings),
                     runtime=runtime, token_stream=runtime.token_stream, session_factory=runtime.sessions)
    with serving(app) as base:
        yield Service(base, new_api_key(url, "alice"), folders, url)


def sentence_transformers(folder: Path, texts: list[str]) -> tuple[np.ndarray, list[int]]:
    """The oracle: sentence-transformers' normalised embeddings, and each text's tokens as it reads them."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    vectors = model.encode(texts, normalize_embeddings=True)
    lengths = [int(mask.sum()) for mask in model.tokenize(texts)["attention_mask"]]
    return np.asarray(vectors), lengths


def vectors(answer: dict[str, Any]) -> np.ndarray:
    """The base64 vectors of an embeddings answer, as OpenAI sends them: little-endian float32."""
    return np.asarray([np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
                       for item in answer["data"]])


@pytest.mark.parametrize("name", ["bert", "qwen"])
@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_the_sdk_gets_what_sentence_transformers_computes(service: Service, name: str,
                                                          encoding_format: str) -> None:
    """base64 is what the SDK asks for when no format is given, and decodes itself."""
    asked: dict[str, Any] = {"encoding_format": "float"} if encoding_format == "float" else {}
    raw = service.client().embeddings.with_raw_response.create(model=name, input=TEXTS, **asked)
    answer = raw.parse()
    want, lengths = sentence_transformers(service.folders[name], TEXTS)
    assert answer.model == name and [item.index for item in answer.data] == [0, 1, 2]
    got = np.asarray([item.embedding for item in answer.data])
    assert got.shape == want.shape
    assert np.abs(got - want).max() < TOLERANCE
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(lengths)
    job = service.get(f"/v1/jobs/{raw.headers['X-Conveyor-Job-Id']}").json()
    assert (job["kind"], job["model"], job["status"]) == ("embedding", name, "succeeded")


def test_dimensions_keep_the_first_components_renormalised_and_token_ids_embed_as_their_text(
        service: Service) -> None:
    from transformers import AutoTokenizer

    client = service.client()
    want, _ = sentence_transformers(service.folders["bert"], TEXTS)
    short = client.embeddings.create(model="bert", input=TEXTS, dimensions=8, encoding_format="float")
    cut = want[:, :8] / np.linalg.norm(want[:, :8], axis=1, keepdims=True)
    assert np.abs(np.asarray([item.embedding for item in short.data]) - cut).max() < TOLERANCE

    ids = [AutoTokenizer.from_pretrained(service.folders["bert"]).encode(text) for text in TEXTS]
    by_ids = client.embeddings.create(model="bert", input=ids, encoding_format="float")
    assert np.abs(np.asarray([item.embedding for item in by_ids.data]) - want).max() < TOLERANCE
    one = client.embeddings.create(model="bert", input=ids[1], encoding_format="float")  # one id list
    assert np.abs(np.asarray(one.data[0].embedding) - want[1]).max() < TOLERANCE


def test_an_embedding_job_is_queued_waited_on_shown_and_delivered(service: Service,
                                                                   receiver: Receiver) -> None:
    body = {"kind": "embedding", "model": "qwen", "input": TEXTS[:2], "encoding_format": "base64",
            "webhook": receiver.url, "metadata": {"batch": "nightly"}}
    created = service.post("/v1/jobs", body)
    assert created.status_code == 202, created.text
    assert (created.json()["kind"], created.json()["result"]) == ("embedding", None)
    job = service.get(f"/v1/jobs/{created.json()['id']}", wait=60).json()
    assert job["status"] == "succeeded", job
    result = job["result"]
    assert (result["object"], result["model"]) == ("list", "qwen")
    direct = service.post("/v1/embeddings", {"model": "qwen", "input": TEXTS[:2],
                                             "encoding_format": "base64"}).json()
    assert np.abs(vectors(result) - vectors(direct)).max() < TOLERANCE  # one step's batch or another's
    assert result["usage"] == direct["usage"]
    assert job["usage"]["prompt_tokens"] == result["usage"]["prompt_tokens"]
    assert job["metadata"] == body["metadata"]

    deadline = time.monotonic() + WAIT_S
    while not receiver.received and time.monotonic() < deadline:
        time.sleep(0.05)
    event = json.loads(receiver.received[0].body)
    assert event["type"] == "job.succeeded" and event["data"]["result"] == result

    replayed = httpx.post(service.url + "/v1/jobs", json=body, timeout=WAIT_S,
                          headers={**service.headers(), "Idempotency-Key": "vectors-1"})
    again = httpx.post(service.url + "/v1/jobs", json=body, timeout=WAIT_S,
                       headers={**service.headers(), "Idempotency-Key": "vectors-1"})
    assert (replayed.status_code, again.status_code) == (202, 200)
    assert again.json()["id"] == replayed.json()["id"]
    service.get(f"/v1/jobs/{replayed.json()['id']}", wait=60)
    deleted = httpx.delete(f"{service.url}/v1/jobs/{job['id']}", headers=service.headers(), timeout=WAIT_S)
    assert deleted.status_code == 200, deleted.text
    assert service.get(f"/v1/jobs/{job['id']}").status_code == 404


LONG = " ".join(["tokens"] * 100)  # over the BERT folder's 64-token max_seq_length


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": []}, "input", "must not be empty"),
    ({"input": ""}, "input", "must not be an empty string"),
    ({"input": ["a", ""]}, "input[1]", "must not be an empty string"),
    ({"input": [1, "a"]}, "input[1]", "must be a token id"),
    ({"input": ["a", ["b"]]}, "input[1]", "must be a string"),
    ({"input": ["a"] * (MAX_INPUTS + 1)}, "input", f"limit of {MAX_INPUTS}"),
    ({"input": [[5, 6], [7, 100000]]}, "input[1][1]", "not in the model's vocabulary"),
    ({"input": ["short", LONG]}, "input[1]", "maximum input length of 64 tokens"),
    ({"input": "a", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
    ({"input": "a", "dimensions": 33}, "dimensions", "embedding size (32)"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format", "float"),
    ({"input": "a", "normalize": True}, "normalize", "Extra inputs"),
])
def test_a_bad_request_is_refused_naming_the_field_or_the_item(service: Service, body: dict[str, Any],
                                                               param: str, words: str) -> None:
    answer = service.post("/v1/embeddings", {"model": "bert", **body})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error
    as_job = service.post("/v1/jobs", {"kind": "embedding", "model": "bert", **body})
    assert as_job.status_code == 422, as_job.text
    assert as_job.json()["error"]["field"] == param, as_job.json()


def test_truncate_embeds_a_long_input_cut_to_the_models_length(service: Service) -> None:
    cut = service.client().embeddings.create(model="bert", input=[LONG], encoding_format="float",
                                             extra_body={"truncate": True})
    want, lengths = sentence_transformers(service.folders["bert"], [LONG])  # truncates to max_seq_length
    assert cut.usage.prompt_tokens == lengths[0] == 64
    assert np.abs(np.asarray(cut.data[0].embedding) - want[0]).max() < TOLERANCE


def test_each_model_serves_its_own_kind_of_request(service: Service) -> None:
    listed = {card["id"]: card for card in service.get("/v1/models").json()["data"]}
    assert {name: (card["task"], card["embedding_size"]) for name, card in listed.items()} == {
        "llama": ("generate", None), "bert": ("embed", 32), "qwen": ("embed", 64)}
    assert (listed["bert"]["max_model_len"], listed["qwen"]["max_model_len"]) == (64, 128)

    client = service.client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="llama", input="hi")
    assert caught.value.body["param"] == "model"  # type: ignore[index]
    assert "`llama` generates text" in caught.value.body["message"]  # type: ignore[index]
    unnamed = service.post("/v1/embeddings", {"input": "hi"})  # no model: the default, llama
    assert unnamed.status_code == 400 and "`llama` generates text" in unnamed.json()["error"]["message"]
    for name in ("bert", "qwen"):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}])
        assert f"`{name}` serves embeddings" in caught.value.body["message"]  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=name, prompt="hi")
        assert f"`{name}` serves embeddings" in caught.value.body["message"]  # type: ignore[index]
    as_job = service.post("/v1/jobs", {"model": "bert", "prompt": "hi"})
    assert as_job.status_code == 422 and "`bert` serves embeddings" in as_job.json()["error"]["message"]
    unknown = service.post("/v1/jobs", {"kind": "vectors", "model": "bert", "input": "hi"})
    assert unknown.status_code == 422, unknown.text
    assert unknown.json()["error"]["field"] == "kind"


def test_the_tokens_per_minute_quota_counts_the_inputs_tokens(service: Service) -> None:
    """A tenant of its own (the others' minute of tokens is spent by the tests above)."""
    bob = dataclasses.replace(service, key=new_api_key(service.database_url, "bob"))
    _, lengths = sentence_transformers(service.folders["bert"], TEXTS)
    db_engine = make_db_engine(service.database_url)
    with make_session_factory(db_engine)() as session:  # room for the inputs once, not twice
        tenants.set_overrides(session, "bob", {"tokens_per_minute": sum(lengths) + 3}, utcnow())
    db_engine.dispose()
    whole = bob.post("/v1/embeddings", {"model": "bert", "input": TEXTS + TEXTS})
    assert whole.status_code == 400 and whole.json()["error"]["param"] == "input", whole.text
    assert whole.json()["error"]["code"] == "tokens_per_minute_exceeded"
    first = bob.post("/v1/embeddings", {"model": "bert", "input": TEXTS})
    assert first.status_code == 200 and first.json()["usage"]["prompt_tokens"] == sum(lengths)
    again = bob.post("/v1/embeddings", {"model": "bert", "input": TEXTS})
    assert again.status_code == 429 and "Retry-After" in again.headers, again.text


def test_an_embeddings_batch_answers_each_line_with_its_vectors_and_refuses_bad_lines(
        service: Service) -> None:
    """A tenant of its own, so that no other test's minute of tokens stands in its way."""
    carol = dataclasses.replace(service, key=new_api_key(service.database_url, "carol"))
    line = {"method": "POST", "url": "/v1/embeddings"}
    lines = [
        {**line, "custom_id": "bert", "body": {"model": "bert", "input": TEXTS, "encoding_format": "float"}},
        {**line, "custom_id": "qwen", "body": {"model": "qwen", "input": TEXTS[1:],
                                               "encoding_format": "base64"}},
        {**line, "custom_id": "cut", "body": {"model": "bert", "input": LONG, "dimensions": 8,
                                              "truncate": True, "encoding_format": "float"}},
        {**line, "custom_id": "too-long", "body": {"model": "bert", "input": ["short", LONG]}},
        {**line, "custom_id": "generator", "body": {"model": "llama", "input": "hi"}},
        {**line, "custom_id": "vocab", "body": {"model": "bert", "input": [[5, 100000]]}},
    ]
    answers = run_batch(carol.client(), lines, "/v1/embeddings")

    want, lengths = sentence_transformers(service.folders["bert"], TEXTS)
    bert = answers.outputs["bert"]
    assert (bert["object"], bert["model"], bert["usage"]["prompt_tokens"]) == ("list", "bert", sum(lengths))
    assert np.abs(np.asarray([item["embedding"] for item in bert["data"]]) - want).max() < TOLERANCE
    want_qwen, qwen_lengths = sentence_transformers(service.folders["qwen"], TEXTS[1:])
    assert np.abs(vectors(answers.outputs["qwen"]) - want_qwen).max() < TOLERANCE
    assert answers.outputs["qwen"]["usage"]["prompt_tokens"] == sum(qwen_lengths)
    want_long, _ = sentence_transformers(service.folders["bert"], [LONG])  # cut to its 64 tokens
    first = want_long[0, :8] / np.linalg.norm(want_long[0, :8])
    cut = answers.outputs["cut"]
    assert cut["usage"]["prompt_tokens"] == 64
    assert np.abs(np.asarray(cut["data"][0]["embedding"]) - first).max() < TOLERANCE

    assert set(answers.outputs) == {"bert", "qwen", "cut"}
    errors = {json.loads(raw)["custom_id"]: json.loads(raw)["error"] for raw in answers.errors.splitlines()}
    assert set(errors) == {"too-long", "generator", "vocab"}
    assert errors["too-long"]["code"] == "prompt_too_long"
    assert errors["too-long"]["message"].startswith("input[1]: ")
    assert "maximum input length of 64 tokens" in errors["too-long"]["message"]
    assert "`llama` generates text" in errors["generator"]["message"]
    assert errors["vocab"]["message"].startswith("input[0][1]: token id 100000")


def test_an_s3_embeddings_batch_writes_the_vectors_to_its_output_prefix(service: Service,
                                                                        s3_url: str) -> None:
    """Conveyor's S3 form: lines without a url (a body holding `input` embeds), outputs under the prefix."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_url, region_name="us-east-1")
    s3.create_bucket(Bucket="vectors")
    lines = [{"custom_id": "qwen", "body": {"model": "qwen", "input": TEXTS, "encoding_format": "float"}},
             {"custom_id": "bert", "body": {"model": "bert", "input": TEXTS[:2]}},  # float, the default
             {"custom_id": "empty", "body": {"model": "bert", "input": ["a", ""]}}]
    s3.put_object(Bucket="vectors", Key="in/corpus.jsonl",
                  Body="".join(json.dumps(line) + "\n" for line in lines).encode())
    dave = dataclasses.replace(service, key=new_api_key(service.database_url, "dave"))
    created = dave.post("/v1/batches", {"input": "s3://vectors/in/corpus.jsonl", "output": "s3://vectors/out/"})
    assert created.status_code == 200, created.text
    batch_id = created.json()["id"]
    deadline = time.monotonic() + WAIT_S
    while dave.get(f"/v1/batches/{batch_id}").json()["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, f"batch {batch_id} did not finish"
        time.sleep(0.1)

    results = [json.loads(raw) for raw in
               s3.get_object(Bucket="vectors", Key="out/results.jsonl")["Body"].read().splitlines()]
    assert [result["custom_id"] for result in results] == ["qwen", "bert", "empty"]
    qwen, bert, empty = (result["response"] for result in results)
    want_qwen, qwen_lengths = sentence_transformers(service.folders["qwen"], TEXTS)
    got_qwen = np.asarray([item["embedding"] for item in qwen["body"]["data"]])
    assert np.abs(got_qwen - want_qwen).max() < TOLERANCE
    assert qwen["body"]["usage"]["prompt_tokens"] == sum(qwen_lengths)
    want_bert, _ = sentence_transformers(service.folders["bert"], TEXTS[:2])
    got_bert = np.asarray([item["embedding"] for item in bert["body"]["data"]])
    assert np.abs(got_bert - want_bert).max() < TOLERANCE
    assert empty is None and results[2]["error"]["message"].startswith("input[1]: ")
    manifest = json.loads(s3.get_object(Bucket="vectors", Key="out/manifest.json")["Body"].read())
    assert manifest["request_counts"] == {"total": 3, "completed": 2, "failed": 1, "cancelled": 0}
