"""Many models behind one API, embedded: a Llama-shaped and a Qwen2-shaped model with different vocabularies,
configured in one TOML file, each with its own engine; every job is answered by the model it names, token
for token as transformers' greedy `generate` answers it, and the API judges and lists each model apart."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM, AutoTokenizer

from conveyor.api.app import create_app
from conveyor.cli.api_server import load_tokenizers
from conveyor.core.settings import load_settings
from tests.support.service import LOCAL_URL

ENGINE = {"max_num_seqs": 8, "max_num_batched_tokens": 128, "num_kv_blocks": 64, "block_size": 16,
          "dtype": "float32", "device": "cpu", "attention_backend": "torch"}
GREEDY = {"temperature": 0, "max_tokens": 10, "ignore_eos": True, "logprobs": 0}
PROMPT = "The queue holds jobs until a worker is free."
WAIT_S = 120.0  # a hang guard, not a speed assertion


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir: Callable[..., Path]) -> dict[str, Path]:
    return {"llama": tiny_model_dir("LlamaForCausalLM"),
            "qwen": tiny_model_dir("Qwen2ForCausalLM", vocab_size=640, hidden_size=96, num_attention_heads=6,
                                   num_key_value_heads=2, seed=7)}


@pytest.fixture
def client(tmp_path: Path, migrated_sqlite_url: str, model_dirs: dict[str, Path]) -> Iterator[TestClient]:
    from conveyor.worker.embedded import EmbeddedRuntime

    config = tmp_path / "conveyor.toml"
    config.write_text(
        f'database_url = "{migrated_sqlite_url}"\nauth_enabled = false\ndata_dir = "{tmp_path / "data"}"\n'
        + "".join(f'{key} = {value!r}\n'.replace("'", '"') for key, value in ENGINE.items())
        + f'[models.llama]\npath = "{model_dirs["llama"]}"\n'
        + f'[models.qwen]\npath = "{model_dirs["qwen"]}"\nmax_model_len = 64\n'
        + '[models.qwen.queues.documents]\nmax_output_tokens = 20\n'
        + '[models.qwen.queues.bulk]\nmax_running = 2\npriority = 2\n')  # a queue of qwen's alone
    settings = load_settings(config)
    runtime = EmbeddedRuntime(settings)
    app = create_app(settings, publisher=runtime.publisher, tokenizer=load_tokenizers(settings),
                     runtime=runtime, session_factory=runtime.sessions)
    with TestClient(app, base_url=LOCAL_URL) as test_client:
        yield test_client


def transformers_greedy(folder: Path, prompt: str, max_tokens: int) -> list[int]:
    """transformers' greedy continuation of the prompt as the engine tokenizes it, EOS stopping off."""
    ids = AutoTokenizer.from_pretrained(folder).encode(prompt)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return list(out[0, len(ids):].tolist())


def finished(client: TestClient, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        job: dict[str, Any] = client.get(f"/v1/jobs/{job_id}", params={"wait": 5}).json()
        if job["status"] not in ("queued", "running"):
            return job
    raise AssertionError(f"job {job_id} never finished")


def tokens_of(job: dict[str, Any]) -> list[int]:
    assert job["status"] == "succeeded", job
    return [entry["token_id"] for entry in job["result"]["logprobs"]]


def test_each_job_is_answered_by_the_model_it_names_token_for_token(
        client: TestClient, model_dirs: dict[str, Path]) -> None:
    submitted = {
        "llama": client.post("/v1/jobs", json={"model": "llama", "prompt": PROMPT, **GREEDY}),
        "qwen": client.post("/v1/jobs", json={"model": "qwen", "prompt": PROMPT, "queue": "documents",
                                              **GREEDY}),
        "default": client.post("/v1/jobs", json={"prompt": PROMPT, **GREEDY}),
    }
    assert {name: r.status_code for name, r in submitted.items()} == dict.fromkeys(submitted, 202)
    jobs = {name: finished(client, r.json()["id"]) for name, r in submitted.items()}
    assert [(jobs[n]["model"], jobs[n]["queue"]) for n in jobs] == [
        ("llama", "interactive"), ("qwen", "documents"), ("llama", "interactive")]
    want = {name: transformers_greedy(folder, PROMPT, int(GREEDY["max_tokens"]))
            for name, folder in model_dirs.items()}
    assert want["llama"] != want["qwen"]
    assert tokens_of(jobs["llama"]) == tokens_of(jobs["default"]) == want["llama"]
    assert tokens_of(jobs["qwen"]) == want["qwen"]

    completion = client.post("/v1/completions", json={"model": "qwen", "prompt": PROMPT, "max_tokens": 10,
                                                      "temperature": 0, "ignore_eos": True})
    assert completion.status_code == 200, completion.text
    assert completion.json()["model"] == "qwen"
    assert completion.json()["choices"][0]["text"] == jobs["qwen"]["result"]["text"]


def test_the_api_lists_both_models_and_judges_each_request_against_its_own(client: TestClient) -> None:
    listed = client.get("/v1/models").json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in listed] == [("llama", 1024), ("qwen", 64)]
    assert all(m["workers"] == 1 for m in listed), listed  # the embedded engine of each

    missing = client.post("/v1/jobs", json={"model": "mistral", "prompt": PROMPT})
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert error["code"] == "model_not_found"
    assert "`mistral`" in error["message"] and "`qwen`" in error["message"]
    chat = client.post("/v1/chat/completions", json={"model": "mistral", "messages": [{"role": "user",
                                                                                        "content": "hi"}]})
    assert chat.status_code == 404 and "`mistral`" in chat.text
    assert client.get("/v1/models/mistral").status_code == 404

    long_output = {"prompt": PROMPT, "max_tokens": 60}  # fits llama's 1024 tokens, not qwen's 64
    assert client.post("/v1/jobs", json={"model": "llama", **long_output}).status_code == 202
    refused = client.post("/v1/jobs", json={"model": "qwen", **long_output})
    assert refused.status_code == 422, refused.text
    documents = client.post("/v1/jobs", json={"model": "qwen", "queue": "documents", "prompt": "x",
                                              "max_tokens": 21})
    assert documents.status_code == 422 and "max_tokens" in documents.text  # qwen's own documents limit

    queues = client.get("/v1/queues").json()["data"]
    assert [(q["model"], q["name"]) for q in queues] == [("llama", "interactive"), ("llama", "documents"),
                                                         ("qwen", "interactive"), ("qwen", "documents"),
                                                         ("qwen", "bulk")]
    assert client.post("/v1/jobs", json={"model": "qwen", "queue": "bulk", "prompt": "x"}).status_code == 202
    no_bulk = client.post("/v1/jobs", json={"model": "llama", "queue": "bulk", "prompt": "x"})
    assert no_bulk.status_code == 422 and no_bulk.json()["error"]["code"] == "unknown_queue"
    scaling = client.get("/v1/scaling").json()
    assert set(scaling["models"]) == {"llama", "qwen"}
    assert set(scaling["models"]["qwen"]["queues"]) == {"interactive", "documents", "bulk"}


def run_batch(client: TestClient, lines: list[dict[str, Any]], **fields: str,
              ) -> tuple[dict[str, Any], dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Uploads the lines, runs them as a /v1/completions batch (with `fields`: its queue) to its end; the
    batch, its answers' bodies by custom_id and its error lines."""
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.post("/v1/files", files={"file": ("lines.jsonl", content)}, data={"purpose": "batch"})
    assert uploaded.status_code == 200, uploaded.text
    created = client.post("/v1/batches", json={"input_file_id": uploaded.json()["id"], **fields,
                                               "endpoint": "/v1/completions", "completion_window": "24h"})
    assert created.status_code == 200, created.text
    deadline = time.monotonic() + WAIT_S
    batch: dict[str, Any] = created.json()
    while batch["status"] not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.2)
        batch = client.get(f"/v1/batches/{batch['id']}").json()
    assert batch["status"] == "completed", batch
    def lines_of(file_id: str | None) -> list[dict[str, Any]]:
        text = client.get(f"/v1/files/{file_id}/content").text if file_id else ""
        return [json.loads(row) for row in text.splitlines()]

    answers = {row["custom_id"]: row["response"]["body"] for row in lines_of(batch["output_file_id"])}
    return batch, answers, lines_of(batch["error_file_id"])


def test_a_batch_mixes_models_line_by_line(client: TestClient) -> None:
    lines = [{"custom_id": f"{model}-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                       "ignore_eos": True}}
             for model in ("llama", "qwen") for i in range(2)]
    lines.append({"custom_id": "nobody", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "mistral", "prompt": PROMPT}})
    _batch, output, errors = run_batch(client, lines)
    assert {custom_id: body["model"] for custom_id, body in output.items()} == {
        "llama-0": "llama", "llama-1": "llama", "qwen-0": "qwen", "qwen-1": "qwen"}
    direct = {model: client.post("/v1/completions", json=lines[index]["body"]).json()["choices"][0]["text"]
              for model, index in (("llama", 0), ("qwen", 2))}
    assert output["llama-0"]["choices"][0]["text"] == direct["llama"]
    assert output["qwen-0"]["choices"][0]["text"] == direct["qwen"] != direct["llama"]
    [error] = errors
    assert error["custom_id"] == "nobody" and error["error"]["code"] == "model_not_found", error
    assert "`mistral`" in error["error"]["message"]


def test_a_batch_on_one_models_own_queue_runs_that_models_lines_only(client: TestClient) -> None:
    lines = [{"custom_id": model, "body": {"model": model, "prompt": PROMPT, "max_tokens": 2}}
             for model in ("qwen", "llama")]
    batch, output, errors = run_batch(client, lines, queue="bulk")
    assert batch["request_counts"] == {"total": 2, "completed": 1, "failed": 1, "cancelled": 0}, batch
    assert list(output) == ["qwen"]
    [error] = errors
    assert error["custom_id"] == "llama" and error["error"]["code"] == "unknown_queue", error
