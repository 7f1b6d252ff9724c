"""Prompt logprobs on the embedded server (demo model): completions' `echo` with `logprobs` (evaluation
harnesses score answers with `echo=True, logprobs=k, max_tokens=0`), vLLM's `prompt_logprobs`, the jobs API
and a batch line; the logprobs checked against transformers running the same model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from test_openai_chat_sdk import MESSAGES, Server, embedded  # noqa: F401 (the module-scoped fixture)

from conveyor.api.prompt_tokenizer import PromptTokenizer
from tests.support.openai_batches import run_batch

PROMPT = "The queue holds jobs until a worker is free."


@pytest.fixture(scope="module")
def reference_logprobs(demo_model_dir: Path, prompt_tokenizer: PromptTokenizer) -> list[float]:
    """Each prompt token's logprob given those before it, by transformers (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    ids = prompt_tokenizer.encode_prompt(PROMPT)
    with torch.no_grad():
        logprobs = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [T, V]
    return [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_echo_with_logprobs_and_no_tokens_scores_the_prompt(
    embedded: Server, prompt_tokenizer: PromptTokenizer, reference_logprobs: list[float]  # noqa: F811
) -> None:
    client = embedded.client()
    scored = client.completions.create(model=embedded.model, prompt=PROMPT, echo=True, logprobs=1,
                                       max_tokens=0)
    choice = scored.choices[0]
    ids = prompt_tokenizer.encode_prompt(PROMPT)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None
    assert len(lp.tokens or []) == len(ids) == len(lp.token_logprobs or []) == len(lp.top_logprobs or [])
    assert (lp.token_logprobs or [])[0] is None and (lp.top_logprobs or [])[0] is None
    assert (lp.token_logprobs or [])[1:] == pytest.approx(reference_logprobs, abs=2e-4)
    assert all(len(top) == 1 for top in (lp.top_logprobs or [])[1:])
    assert scored.usage is not None and scored.usage.completion_tokens == 0
    assert scored.usage.prompt_tokens == len(ids)


def test_echo_before_generated_tokens_and_without_logprobs(embedded: Server) -> None:  # noqa: F811
    client = embedded.client()
    greedy: dict[str, Any] = dict(model=embedded.model, prompt=PROMPT, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    plain = client.completions.create(**greedy).choices[0]
    echoed = client.completions.create(**greedy, echo=True, logprobs=2).choices[0]
    assert echoed.text == PROMPT + plain.text
    lp = echoed.logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) > 4
    assert "".join(lp.tokens[-4:]) == plain.text  # the generated tokens follow the prompt's
    text_only = client.completions.create(model=embedded.model, prompt=PROMPT, echo=True, max_tokens=0)
    assert text_only.choices[0].text == PROMPT and text_only.choices[0].logprobs is None
    streamed = client.completions.create(**greedy, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == PROMPT + plain.text


def test_vllm_prompt_logprobs_on_completions_and_chat(
    embedded: Server, reference_logprobs: list[float]  # noqa: F811
) -> None:
    client = embedded.client()
    text = client.completions.create(model=embedded.model, prompt=PROMPT, max_tokens=1,
                                     extra_body={"prompt_logprobs": 2})
    shaped = text.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert shaped[0] is None and len(shaped) == len(reference_logprobs) + 1
    for entry, expected in zip(shaped[1:], reference_logprobs, strict=True):
        assert 2 <= len(entry) <= 3  # the prompt token and its 2 alternatives
        assert any(v["logprob"] == pytest.approx(expected, abs=2e-4) for v in entry.values())
        ranked = sorted((v["rank"], v["logprob"]) for v in entry.values() if v["rank"] is not None)
        assert [rank for rank, _ in ranked] == [1, 2] and ranked[0][1] >= ranked[1][1]
    chat = client.chat.completions.create(model=embedded.model, messages=MESSAGES, max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    prompt_logprobs = chat.model_extra["prompt_logprobs"]  # type: ignore[index]
    assert chat.usage is not None and len(prompt_logprobs) == chat.usage.prompt_tokens
    assert prompt_logprobs[0] is None and all(len(entry) == 1 for entry in prompt_logprobs[1:])


def test_refusals_name_the_field(embedded: Server) -> None:  # noqa: F811
    client = embedded.client()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ({"prompt": PROMPT, "max_tokens": 0, "echo": True, "n": 2}, "n"),
        ({"prompt": PROMPT, "stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
    ]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=embedded.model, **body)
        assert caught.value.body["param"] == param, (body, caught.value.body)  # type: ignore[index]


def test_jobs_api_and_a_batch_line_score_the_prompt_alike(embedded: Server,  # noqa: F811
                                                          reference_logprobs: list[float]) -> None:
    headers = {"Authorization": f"Bearer {embedded.key}"}
    created = httpx.post(f"{embedded.url}/v1/jobs", headers=headers,
                         json={"prompt": PROMPT, "max_tokens": 0, "prompt_logprobs": 1})
    assert created.status_code == 202, created.text
    job = httpx.get(f"{embedded.url}/v1/jobs/{created.json()['id']}", params={"wait": 60}, headers=headers,
                    timeout=90).json()
    scored = job["result"]["prompt_logprobs"]
    assert scored[0]["logprob"] is None and scored[0]["top_logprobs"] == []
    assert [e["logprob"] for e in scored[1:]] == pytest.approx(reference_logprobs, abs=2e-4)
    refused = httpx.post(f"{embedded.url}/v1/jobs", headers=headers, json={"prompt": PROMPT, "max_tokens": 0})
    assert refused.status_code == 422 and "max_tokens" in refused.text

    client = embedded.client()
    body = {"model": embedded.model, "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0}
    lines = [{"custom_id": "score", "method": "POST", "url": "/v1/completions", "body": body},
             {"custom_id": "bad", "method": "POST", "url": "/v1/completions",
              "body": {**body, "echo": False}}]
    answers = run_batch(client, lines, "/v1/completions")
    routed = client.completions.create(**body).choices[0]
    answered = answers.outputs["score"]["choices"][0]
    assert answered["text"] == routed.text == PROMPT
    assert answered["logprobs"]["token_logprobs"] == pytest.approx(
        (routed.logprobs.token_logprobs if routed.logprobs else None), abs=1e-6)  # first None both
    assert "bad" in answers.errors
