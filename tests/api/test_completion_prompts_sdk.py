"""/v1/completions' `prompt` in every shape OpenAI and vLLM take (a string, a list of strings, a list of
token ids, a list of token-id lists) on the embedded server (demo model), through the official SDK: one
choice per prompt in order, n per prompt (`index` prompt * n + choice), streamed under the same indexes;
token ids read as sent (no BOS), echoed exactly with their logprobs (checked against transformers on the same
ids); usage over every prompt; a bad token id or a prompt too long refused naming it; a batch line and a job
take the same shapes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from test_openai_chat_sdk import Server, embedded, workerless  # noqa: F401 (the fixtures)

from conveyor.api.prompt_tokenizer import PromptTokenizer
from tests.support.openai_batches import run_batch

FIRST, SECOND = "The queue holds jobs until a worker is free.", "Batches run overnight"
GREEDY: dict[str, Any] = {"max_tokens": 4, "temperature": 0, "extra_body": {"ignore_eos": True}}


def _ids(tokenizer: PromptTokenizer, text: str) -> list[int]:
    """The text's tokens without the BOS the tokenizer would add: what a harness that tokenizes sends."""
    return tokenizer.encode_prompt(text, add_special_tokens=False)


def _texts(completion: Any) -> list[str]:
    assert [choice.index for choice in completion.choices] == list(range(len(completion.choices)))
    return [choice.text for choice in completion.choices]


def test_each_prompt_gets_its_n_choices_in_order(embedded: Server,  # noqa: F811
                                                 prompt_tokenizer: PromptTokenizer) -> None:
    client = embedded.client()
    first, second = _ids(prompt_tokenizer, FIRST), _ids(prompt_tokenizer, SECOND)
    alone = [client.completions.create(model=embedded.model, prompt=ids, **GREEDY) for ids in (first, second)]
    both = client.completions.create(model=embedded.model, prompt=[first, second], n=2, **GREEDY)
    # choice c of prompt p is index p * n + c; greedy, so a prompt's two choices are its answer alone
    assert _texts(both) == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert both.usage is not None and both.usage.prompt_tokens == len(first) + len(second)
    assert both.usage.completion_tokens == 4 * 4
    assert alone[0].usage is not None and alone[0].usage.prompt_tokens == len(first)  # no BOS added

    texts = client.completions.create(model=embedded.model, prompt=[FIRST, SECOND], **GREEDY)
    singles = [client.completions.create(model=embedded.model, prompt=text, **GREEDY)
               for text in (FIRST, SECOND)]
    assert _texts(texts) == [single.choices[0].text for single in singles]
    # A text prompt gets the tokenizer's BOS; the same tokens sent as ids, BOS included, answer alike.
    with_bos = client.completions.create(model=embedded.model, prompt=prompt_tokenizer.encode_prompt(FIRST),
                                         **GREEDY)
    assert _texts(with_bos) == [singles[0].choices[0].text]


def _reference(model_dir: Path, ids: list[int]) -> list[float]:
    """Each token's logprob given the ones before it, by transformers (float32) on exactly these ids."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [T, V]
    return [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_echo_gives_back_the_token_ids_as_sent_with_their_logprobs(
    embedded: Server, prompt_tokenizer: PromptTokenizer, demo_model_dir: Path  # noqa: F811
) -> None:
    """lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs 1, max_tokens 1."""
    first, second = _ids(prompt_tokenizer, FIRST), _ids(prompt_tokenizer, SECOND)
    scored = embedded.client().completions.create(model=embedded.model, prompt=[first, second], echo=True,
                                                  logprobs=1, max_tokens=1, temperature=0, seed=1234)
    for choice, ids in zip(scored.choices, (first, second), strict=True):
        lp = choice.logprobs
        assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
        assert lp.top_logprobs is not None
        assert choice.text.startswith(prompt_tokenizer.decode(ids))
        assert lp.tokens[: len(ids)] == [prompt_tokenizer.decode([token]) for token in ids]  # no BOS before
        assert len(lp.token_logprobs) == len(ids) + 1  # the prompt's tokens, then the one generated
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1: len(ids)] == pytest.approx(_reference(demo_model_dir, ids), abs=2e-4)
        assert all(len(top) == 1 for top in lp.top_logprobs[1:])
    assert scored.usage is not None and scored.usage.prompt_tokens == len(first) + len(second)


def test_several_prompts_stream_under_their_choice_index(embedded: Server,  # noqa: F811
                                                         prompt_tokenizer: PromptTokenizer) -> None:
    client = embedded.client()
    prompts = [_ids(prompt_tokenizer, FIRST), _ids(prompt_tokenizer, SECOND)]
    whole = client.completions.create(model=embedded.model, prompt=prompts, n=2, echo=True, **GREEDY)
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    for part in client.completions.create(model=embedded.model, prompt=prompts, n=2, echo=True, stream=True,
                                          stream_options={"include_usage": True}, **GREEDY):
        usage = part.usage or usage
        for choice in part.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert [texts[index] for index in range(4)] == _texts(whole)
    assert texts[2].startswith(prompt_tokenizer.decode(prompts[1]))  # echo: each choice's own prompt
    assert finishes == {index: "length" for index in range(4)}
    assert usage is not None and whole.usage is not None and usage.prompt_tokens == whole.usage.prompt_tokens


def test_a_token_id_the_model_lacks_is_refused_naming_it(embedded: Server) -> None:  # noqa: F811
    client = embedded.client()
    for prompt, param in (([[1, 2], [3, 100_000]], "prompt[1][1]"), ([7, 100_000], "prompt[1]"),
                          ([[1], "text"], "prompt[1]"), ([[1], []], "prompt[1]")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=embedded.model, prompt=prompt, max_tokens=1)  # type: ignore[arg-type]
        assert caught.value.body["param"] == param, caught.value.body  # type: ignore[index]


def test_each_prompt_is_held_to_the_context(workerless: Server) -> None:  # noqa: F811
    """max_model_len 80: each prompt + max_tokens must fit, and the refusal says which prompt does not."""
    client = workerless.client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=workerless.model, prompt=[[5] * 10, [5] * 70], max_tokens=16)
    body: Any = caught.value.body
    assert body["param"] == "max_tokens" and "(prompt[1])" in body["message"], body


def test_a_batch_line_and_a_job_take_token_ids(embedded: Server,  # noqa: F811
                                               prompt_tokenizer: PromptTokenizer) -> None:
    client = embedded.client()
    prompts = [_ids(prompt_tokenizer, FIRST), _ids(prompt_tokenizer, SECOND)]
    body = {"model": embedded.model, "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 2,
            "temperature": 0, "ignore_eos": True}
    answers = run_batch(client, [{"custom_id": "ids", "method": "POST", "url": "/v1/completions",
                                  "body": body}], "/v1/completions")
    routed = client.completions.create(**{k: v for k, v in body.items() if k != "ignore_eos"},
                                       extra_body={"ignore_eos": True})
    line = answers.outputs["ids"]
    assert [c["text"] for c in line["choices"]] == _texts(routed)
    assert [c["logprobs"]["tokens"] for c in line["choices"]] == [c.logprobs.tokens for c in routed.choices
                                                                  if c.logprobs is not None]
    assert line["usage"]["prompt_tokens"] == len(prompts[0]) + len(prompts[1])

    headers = {"Authorization": f"Bearer {embedded.key}"}
    created = httpx.post(f"{embedded.url}/v1/jobs", headers=headers, json={
        "prompt": prompts, "max_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert created.status_code == 202, created.text
    job = httpx.get(f"{embedded.url}/v1/jobs/{created.json()['id']}", params={"wait": 60}, headers=headers,
                    timeout=90).json()
    assert job["status"] == "succeeded", job
    assert [c["text"] for c in job["result"]["choices"]] == [c.text[len(prompt_tokenizer.decode(ids)):]
                                                            for c, ids in zip(routed.choices, prompts,
                                                                              strict=True)]
    assert job["usage"]["prompt_tokens"] == len(prompts[0]) + len(prompts[1])
