"""The pieces of every stream join exactly to the final text: the job's `event: delta` stream, and the OpenAI
SDK's streamed completions and chats, on the random-weight demo model, whose byte-level tokenizer writes
characters split across tokens, invalid bytes and NUL (which the store keeps as U+FFFD). Before, one stream
in twenty ended in "the job was restarted and generated a different text"."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from conveyor.api.app import create_app
from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.core.settings import Settings
from tests.support.live_server import serving
from tests.support.sse import job_events

ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=256, num_kv_blocks=256, block_size=16, dtype="float32",
              device="cpu", attention_backend="torch")
SEEDS = range(24)
WAIT_S = 120.0  # a hang guard, not a speed assertion


@pytest.fixture(scope="module")
def url(_migrated_sqlite_file: Path, tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path,
        prompt_tokenizer: PromptTokenizer) -> Iterator[str]:
    from conveyor.worker.embedded import EmbeddedRuntime

    data = tmp_path_factory.mktemp("stream-pieces")
    shutil.copyfile(_migrated_sqlite_file, data / "conveyor.db")
    settings = Settings(data_dir=data, database_url=f"sqlite:///{data / 'conveyor.db'}", auth_enabled=False,
                        model=str(demo_model_dir), **ENGINE)
    runtime = EmbeddedRuntime(settings)
    app = create_app(settings, publisher=runtime.publisher, tokenizer=prompt_tokenizer, runtime=runtime,
                     token_stream=runtime.token_stream, finished_watch=runtime.finished,
                     finished_sink=runtime.finished)
    with serving(app) as served:
        yield served


def test_the_job_events_deltas_join_to_the_result(url: str) -> None:
    with httpx.Client(base_url=url, timeout=WAIT_S) as http:
        for seed in SEEDS:
            body = {"prompt": f"Tell me {seed}", "max_tokens": 40, "temperature": 1.0, "seed": seed,
                    "delay_s": 0.3}  # starts after the stream listens
            job = http.post("/v1/jobs", json=body).json()
            with http.stream("GET", f"/v1/jobs/{job['id']}/events") as stream:
                events = list(job_events(stream.iter_lines()))
            text = "".join(data["text"] for kind, data in events if kind == "delta")
            assert text == events[-1][1]["result"]["text"], seed


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_the_openai_streams_join_to_the_answer(url: str, kind: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=WAIT_S, max_retries=0)
    for seed in SEEDS:
        asked: dict[str, Any] = dict(model="demo-model", max_tokens=40, temperature=1.0, seed=seed)
        if kind == "chat":
            messages: Any = [{"role": "user", "content": f"Tell me {seed}"}]
            pieces = [chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
                messages=messages, stream=True, **asked) if chunk.choices]
            answer = client.chat.completions.create(messages=messages, **asked).choices[0].message.content
        else:
            pieces = [chunk.choices[0].text for chunk in client.completions.create(
                prompt=f"Tell me {seed}", stream=True, **asked) if chunk.choices]
            answer = client.completions.create(prompt=f"Tell me {seed}", **asked).choices[0].text
        assert "".join(pieces) == answer, seed
