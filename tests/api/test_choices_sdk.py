"""Several choices (`n`) on the embedded server (demo model) through the official `openai` SDK, the jobs API
and a batch line: n choices from one prompt, usage counting every choice's tokens as OpenAI does."""

from __future__ import annotations

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

from tests.support.openai_batches import run_batch

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


def test_n_is_bounded(embedded: Server) -> None:  # noqa: F811
    with pytest.raises(openai.BadRequestError) as caught:
        embedded.client().chat.completions.create(model=embedded.model, messages=MESSAGES, n=17, max_tokens=2)
    assert caught.value.body["param"] == "n", caught.value.body  # type: ignore[index]


@pytest.mark.parametrize("chat", [True, False])
def test_n_choices_stream_by_index_as_they_answer_whole(embedded: Server, chat: bool) -> None:  # noqa: F811
    client = embedded.client()
    if chat:
        def create(**extra: Any) -> Any:
            return client.chat.completions.create(model=embedded.model, messages=MESSAGES, n=3, **SAMPLED,
                                                  **extra)
    else:
        def create(**extra: Any) -> Any:
            return client.completions.create(model=embedded.model, prompt="The queue holds", n=3, **SAMPLED,
                                             **extra)
    whole = create()
    texts = {0: "", 1: "", 2: ""}
    finishes = {}
    usage = None
    for part in create(stream=True, stream_options={"include_usage": True}):
        usage = part.usage or usage
        for choice in part.choices:
            piece = choice.delta.content if chat else choice.text
            texts[choice.index] += piece or ""
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    expected = [c.message.content if chat else c.text for c in whole.choices]
    assert [texts[i] for i in range(3)] == expected  # seeded: the same three choices
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert usage is not None and usage.completion_tokens == 3 * 8


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
    answers = run_batch(client, lines, "/v1/chat/completions")
    answer = answers.outputs["two"]
    sdk_body = {name: value for name, value in body.items() if name != "ignore_eos"}
    routed = client.chat.completions.create(**sdk_body, extra_body={"ignore_eos": True})
    assert [c["message"]["content"] for c in answer["choices"]] == [c.message.content for c in routed.choices]
    assert answer["usage"]["completion_tokens"] == 8
    assert "many" in answers.errors
