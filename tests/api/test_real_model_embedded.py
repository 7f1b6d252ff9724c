"""The embedded server serving a real model, SmolLM2-135M-Instruct (a Llama with the ChatML template,
converted from its GGUF file), driven by the official `openai` SDK: a greedy chat answers the question
without the template leaking into it, and token for token as transformers does; structured output and a
required tool call carry sensible values; prompt and answer logprobs equal transformers' on the same ids
(transformers loading the GGUF file itself, so the reference shares none of Conveyor's conversion)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from test_openai_chat_sdk import Server

from conveyor.api.app import create_app
from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.core.settings import Settings
from conveyor.core.store.migrate import upgrade
from tests.support.live_server import new_api_key, serving

# fp32 activations on CPU over the file's own int4 weights (equal to transformers to 1e-4), two sequences
# at a time, two torch threads: 2 shared cores.
ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=256, num_kv_blocks=64, block_size=16, max_model_len=512,
              dtype="float32", device="cpu", attention_backend="torch", num_threads=2)
QUESTION = "What is the capital of France? Answer in one sentence."
TEMPLATE_MARKS = ("<|im_start|>", "<|im_end|>", "assistant\n")
JSON_QUESTION = "What is the capital of France? Reply in JSON with the city and its country."
SENTENCE = "The quick brown fox jumps over the lazy dog."
CAPITAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
}
WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}

pytestmark = pytest.mark.xdist_group("smollm2")  # transformers' reference loaded once (tests/conftest.py)


@dataclass
class Reference:
    """transformers on the GGUF file itself (float32), with the GGUF file's tokenizer."""
    model: Any
    tokenizer: Any

    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), vocab]: row i is the distribution of the token after ids[: i + 1]."""
        with torch.no_grad():
            return self.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    def greedy(self, ids: list[int], max_new_tokens: int) -> list[int]:
        with torch.no_grad():
            out = self.model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                      eos_token_id=self.tokenizer.eos_token_id,
                                      pad_token_id=self.tokenizer.eos_token_id)
        return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[Server]:
    from conveyor.worker.embedded import EmbeddedRuntime

    tmp = tmp_path_factory.mktemp("real-model-embedded")
    url = f"sqlite:///{tmp / 'conveyor.db'}"
    upgrade(url)
    settings = Settings(data_dir=tmp, database_url=url, model=str(smollm2_dir), auth_enabled=True,
                        reconcile_interval_s=0.2, dispatch_grace_s=0.5, worker_heartbeat_s=0.2,
                        cancel_poll_s=0.1, **ENGINE)
    runtime = EmbeddedRuntime(settings)
    app = create_app(settings, publisher=runtime.publisher, tokenizer=PromptTokenizer(smollm2_dir),
                     runtime=runtime, token_stream=runtime.token_stream, finished_watch=runtime.finished,
                     finished_sink=runtime.finished)
    with serving(app) as base:
        yield Server(base, new_api_key(url, "alice"), smollm2_dir.name, url, runtime, settings)


@pytest.fixture(scope="module")
def reference(smollm2_transformers: tuple[Any, Any]) -> Reference:
    return Reference(*smollm2_transformers)


def _chat_ids(reference: Reference, messages: list[dict[str, Any]]) -> list[int]:
    text = reference.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(reference.tokenizer.encode(text, add_special_tokens=False))


def test_a_greedy_chat_answers_paris_as_transformers_does(server: Server, reference: Reference) -> None:
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    answer = server.client().chat.completions.create(model=server.model, messages=messages, temperature=0,
                                                     max_tokens=32)
    choice = answer.choices[0]
    content = choice.message.content or ""
    assert choice.finish_reason == "stop" and choice.message.role == "assistant"
    assert "Paris" in content
    assert not [mark for mark in TEMPLATE_MARKS if mark in content], content
    prompt_ids = _chat_ids(reference, messages)
    expected = reference.greedy(prompt_ids, 32)
    assert expected[-1] == reference.tokenizer.eos_token_id  # <|im_end|>: the model stopped by itself
    assert content == reference.tokenizer.decode(expected[:-1])
    assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt_ids)
    assert answer.usage.completion_tokens == len(expected)  # the answer and its <|im_end|>
    assert answer.usage.total_tokens == len(prompt_ids) + len(expected)


def test_structured_output_names_paris_and_france(server: Server) -> None:
    messages: list[Any] = [{"role": "user", "content": JSON_QUESTION}]
    response_format: Any = {"type": "json_schema",
                            "json_schema": {"name": "capital", "schema": CAPITAL_SCHEMA}}
    answer = server.client().chat.completions.create(model=server.model, messages=messages, temperature=0,
                                                     max_tokens=48, response_format=response_format)
    choice = answer.choices[0]
    assert choice.finish_reason == "stop", choice
    parsed = json.loads(choice.message.content or "")
    jsonschema.validate(parsed, CAPITAL_SCHEMA)
    assert "paris" in parsed["city"].lower() and "france" in parsed["country"].lower(), parsed


def test_a_required_tool_call_asks_for_the_weather_in_paris(server: Server) -> None:
    messages: list[Any] = [{"role": "user", "content": "What's the weather like in Paris today?"}]
    answer = server.client().chat.completions.create(model=server.model, messages=messages, tools=[WEATHER],
                                                     tool_choice="required", temperature=0, max_tokens=48)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"  # type: ignore[union-attr]
    arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    assert "paris" in arguments["city"].lower(), arguments


def test_prompt_and_answer_logprobs_equal_transformers(server: Server, reference: Reference) -> None:
    ids = list(reference.tokenizer.encode(SENTENCE))
    assert ids == reference.tokenizer.encode(SENTENCE, add_special_tokens=False)  # SmolLM2 adds no BOS
    expected = reference.logprobs(ids)
    client = server.client()
    scored = client.completions.create(model=server.model, prompt=SENTENCE, echo=True, logprobs=1,
                                       max_tokens=0)  # scores the prompt alone, as evaluation harnesses do
    choice = scored.choices[0]
    assert choice.text == SENTENCE and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
    assert lp.tokens == [reference.tokenizer.decode([i]) for i in ids]  # each token's text
    assert lp.token_logprobs[0] is None  # the first token has nothing before it
    want = [expected[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert scored.usage is not None and scored.usage.prompt_tokens == len(ids)
    assert scored.usage.completion_tokens == 0

    one = client.completions.create(model=server.model, prompt=SENTENCE, max_tokens=1, temperature=0,
                                    logprobs=1).choices[0]
    best = int(expected[-1].argmax())
    assert one.logprobs is not None and one.logprobs.token_logprobs is not None
    assert one.text == reference.tokenizer.decode([best])
    assert one.logprobs.token_logprobs[0] == pytest.approx(expected[-1, best].item(), abs=1e-4)


def test_the_model_list_says_the_weights_are_the_gguf_files_int4(server: Server) -> None:
    """The Q4_1 file runs from its own 4-bit values (engine/quantization.py), and /v1/models says so."""
    card = server.client().models.retrieve(server.model)
    assert (card.model_extra or {})["quantization"] == "int4"
