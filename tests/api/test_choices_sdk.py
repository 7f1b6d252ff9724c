"""Several choices (`n`) on the embedded server (demo model) through the official `openai` SDK, the jobs API
and a batch line: n choices from one prompt, usage counting every choice's tokens as OpenAI does."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from test_openai_chat_sdk import (  # noqa: F401 (embedded: the module-scoped fixture)
    MESSAGES,
    Server,
    embedded,
    job_id_of,
)

from tests.support.live_server import wait_for

SAMPLED: dict[str, Any] = {"temperature": 1.0, "seed": 11, "max_tokens": 8,
                           "extra_body": {"ignore_eos": True}}


def test_chat_and_completions_return_n_choices(embedded: Server) -> None:  # noqa: F811
    client = embedded.client()
    chat = client.chat.completions.create(model=embedded.model, messages=MESSAGES, n=3, **SAMPLED)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.message.content for c in chat.choices)
    assert len({c.message.content for c in chat.choices}) > 1, "each choice samples on its own"
    assert chat.usage is not None and chat.usage.completion_tokens == 3 * 8
    job = embedded.job(job_id_of(chat.id))
    assert [c["text"] for c in job.choices] == [c.message.content for c in chat.choices]
    assert chat.usage.prompt_tokens == job.prompt_tokens  # the prompt counts once
    asked: dict[str, Any] = dict(model=embedded.model, prompt="The queue holds", n=2, logprobs=1, **SAMPLED)
    text = client.completions.create(**asked)
    assert [c.index for c in text.choices] == [0, 1]
    assert all(c.logprobs is not None and len(c.logprobs.tokens or []) == 8 for c in text.choices)
    again = client.completions.create(**asked)
    assert [c.text for c in again.choices] == [c.text for c in text.choices]  # seeded: the same choices


def test_n_is_bounded_and_not_streamed(embedded: Server) -> None:  # noqa: F811
    client = embedded.client()
    for extra, param in (({"n": 17}, "n"), ({"n": 2, "stream": True}, "n")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=embedded.model, messages=MESSAGES, **{**SAMPLED, **extra})
        assert caught.value.body["param"] == param, caught.value.body  # type: ignore[index]


def test_jobs_api_and_a_batch_line_keep_every_choice(embedded: Server) -> None:  # noqa: F811
    headers = {"Authorization": f"Bearer {embedded.key}"}
    created = httpx.post(f"{embedded.url}/v1/jobs", headers=headers, json={
        "prompt": "The river is calm", "n": 2, "max_tokens": 4, "temperature": 1.0, "ignore_eos": True})
    assert created.status_code == 202, created.text
    job = httpx.get(f"{embedded.url}/v1/jobs/{created.json()['id']}", params={"wait": 60}, headers=headers,
                    timeout=90).json()
    assert job["status"] == "succeeded" and job["usage"]["completion_tokens"] == 8, job
    assert [c["index"] for c in job["result"]["choices"]] == [0, 1]
    assert job["result"]["text"] == job["result"]["choices"][0]["text"]

    client = embedded.client()
    body = {"model": embedded.model, "messages": MESSAGES, "n": 2, "max_tokens": 4, "temperature": 1.0,
            "seed": 5, "ignore_eos": True}
    lines = [{"custom_id": "two", "method": "POST", "url": "/v1/chat/completions", "body": body},
             {"custom_id": "many", "method": "POST", "url": "/v1/chat/completions",
              "body": {**body, "n": 99}}]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("n.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).status in ("completed", "failed"), f"batch {batch.id}")
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.output_file_id and done.error_file_id, done
    [line] = [json.loads(r) for r in client.files.content(done.output_file_id).text.splitlines()
              if json.loads(r)["custom_id"] == "two"]
    answer = line["response"]["body"]
    sdk_body = {name: value for name, value in body.items() if name != "ignore_eos"}
    routed = client.chat.completions.create(**sdk_body, extra_body={"ignore_eos": True})
    assert [c["message"]["content"] for c in answer["choices"]] == [c.message.content for c in routed.choices]
    assert answer["usage"]["completion_tokens"] == 8
    assert "many" in client.files.content(done.error_file_id).text
