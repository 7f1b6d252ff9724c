from __future__ import annotations

import json

import pytest

from conveyor.engine.tokenizer import Tokenizer
from conveyor.worker.batches.lines import (
    COMPLETIONS,
    BatchRequest,
    CustomIdSet,
    LineError,
    LineLimits,
    parse_line,
)
from conveyor.worker.batches.prompt_length import prompt_token_counter


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    from conveyor.engine.demo import build_tiny_model

    return Tokenizer(build_tiny_model(tmp_path_factory.mktemp("batch-tokenizer")))


def _parse(body: dict[str, object], limits: LineLimits) -> BatchRequest | LineError:
    return parse_line(1, json.dumps({"custom_id": "a", "body": body}).encode(), CustomIdSet(), limits)


def test_counts_what_the_engine_sees(tokenizer: Tokenizer) -> None:
    count = prompt_token_counter(tokenizer)
    messages = [{"role": "user", "content": "hello there"}]
    chat = _parse({"messages": messages}, LineLimits())
    text = _parse({"prompt": "hello there"}, LineLimits())
    # A line's token-id prompt is counted as sent (each of several is counted as a one-prompt line).
    ids = BatchRequest(line=1, custom_id="b", endpoint=COMPLETIONS, messages=None, prompt=[5, 6, 7],
                       params={}, model=None)
    assert isinstance(chat, BatchRequest) and isinstance(text, BatchRequest)
    assert count(chat) == len(tokenizer.apply_chat_template(messages))
    assert count(text) == len(tokenizer.encode("hello there"))
    assert count(ids) == 3


def test_prompt_limit_uses_the_counter(tokenizer: Tokenizer) -> None:
    count = prompt_token_counter(tokenizer)
    limit = len(tokenizer.encode("word " * 10))
    limits = LineLimits(max_prompt_tokens=limit, count_tokens=count)
    assert isinstance(_parse({"prompt": "word " * 10}, limits), BatchRequest)
    error = _parse({"prompt": "word " * 40}, limits)
    assert isinstance(error, LineError) and error.code == "prompt_too_long"
    assert f"the queue's {limit}" in error.message


def test_counter_value_error_is_a_bad_line() -> None:
    class Rejecting:
        def encode(self, text: str) -> list[int]:
            return [1]

        def apply_chat_template(self, messages: list[dict[str, str]], **template_kwargs: object) -> list[int]:
            raise ValueError("messages: the chat template rejected them: roles must alternate")

    limits = LineLimits(max_prompt_tokens=10, count_tokens=prompt_token_counter(Rejecting()))
    error = _parse({"messages": [{"role": "assistant", "content": "x"}]}, limits)
    assert isinstance(error, LineError) and error.code == "invalid_body" and "alternate" in error.message


def test_each_prompt_of_a_line_is_counted_and_held_to_the_limits_on_its_own(tokenizer: Tokenizer) -> None:
    count = prompt_token_counter(tokenizer)
    limit = len(tokenizer.encode("word " * 10))
    limits = LineLimits(max_prompt_tokens=limit, count_tokens=count, vocab_size=tokenizer.vocab_size)
    texts = _parse({"prompt": ["hello there", "word " * 10]}, limits)
    assert isinstance(texts, BatchRequest) and texts.inputs == ["hello there", "word " * 10]
    assert texts.prompt_tokens == len(tokenizer.encode("hello there")) + limit
    ids = _parse({"prompt": [[5, 6, 7], [8] * limit]}, limits)  # read as sent: nothing added
    assert isinstance(ids, BatchRequest) and ids.prompt_tokens == 3 + limit
    too_long = _parse({"prompt": ["hello there", "word " * 40]}, limits)
    assert isinstance(too_long, LineError) and too_long.code == "prompt_too_long"
    assert too_long.message.startswith("prompt[1]: ")
    unknown = _parse({"prompt": [[5, 6], [7, tokenizer.vocab_size]]}, limits)
    assert isinstance(unknown, LineError) and unknown.code == "invalid_body"
    assert unknown.message.startswith(f"prompt[1][1]: token id {tokenizer.vocab_size} is not in the model's")
