"""Batch lines for /v1/embeddings: held to POST /v1/embeddings' rules and to the model's limits, each refusal
a line error naming the field or the input item."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from conveyor.core.protocol.embedding_request import EMBEDDINGS
from conveyor.core.protocol.embedding_rules import EmbeddingLimits
from conveyor.core.protocol.job_kinds import EMBEDDING, GENERATION
from conveyor.core.protocol.model_task import ModelTask
from conveyor.core.protocol.openai_request import Served
from conveyor.worker.batches.lines import (
    CHAT,
    COMPLETIONS,
    BatchRequest,
    CustomIdSet,
    LineError,
    LineLimits,
    parse_line,
)

EMBEDDER = ModelTask("embed", embedding_size=8, max_input_tokens=6, vocab_size=100)
LIMITS = LineLimits(served=Served(models=("embedder",)), task=EMBEDDER,
                    embedding=EmbeddingLimits(max_inputs=3, vocab_size=100, max_input_tokens=6,
                                              embedding_size=8),
                    count_input=lambda text: len(text.split()) + 2)  # words plus [CLS] and [SEP]


def _parse(line: dict[str, Any], limits: LineLimits = LIMITS) -> BatchRequest | LineError:
    return parse_line(5, json.dumps(line).encode(), CustomIdSet(), limits)


def test_embeddings_line_becomes_an_embedding_job_request_with_its_tokens() -> None:
    request = _parse({"custom_id": "a", "method": "POST", "url": EMBEDDINGS, "body": {
        "model": "embedder", "input": ["one two", "three"], "dimensions": 4, "encoding_format": "base64",
        "priority": 0}})
    assert isinstance(request, BatchRequest)
    assert (request.endpoint, request.kind, request.model) == (EMBEDDINGS, EMBEDDING, "embedder")
    assert request.inputs == ["one two", "three"] and request.prompt is None and request.messages is None
    assert request.params == {"max_tokens": 0, "dimensions": 4, "encoding_format": "base64"}
    assert request.prompt_tokens == 4 + 3
    ids = _parse({"custom_id": "b", "url": EMBEDDINGS, "body": {"input": [[5, 6, 7], [8]]}})
    assert isinstance(ids, BatchRequest) and ids.inputs == [[5, 6, 7], [8]] and ids.prompt_tokens == 4


def test_a_line_without_url_embeds_when_its_body_holds_input_alone() -> None:
    request = _parse({"custom_id": "a", "body": {"input": "hello world"}})
    assert isinstance(request, BatchRequest) and request.endpoint == EMBEDDINGS and request.inputs == [
        "hello world"]
    generation = _parse({"custom_id": "b", "body": {"prompt": "x"}}, replace(LIMITS, task=None))
    assert isinstance(generation, BatchRequest) and generation.kind == GENERATION


def test_truncate_embeds_the_first_tokens_and_counts_them() -> None:
    long_text = "w " * 10  # 12 tokens with the specials, over the model's 6
    request = _parse({"custom_id": "a", "body": {"input": long_text, "truncate": True}})
    assert isinstance(request, BatchRequest)
    assert request.params["truncate"] is True and request.prompt_tokens == 6


@pytest.mark.parametrize(("body", "code", "fragment"), [
    ({"input": "w " * 10}, "prompt_too_long", "input[0]: 12 tokens exceeds the model's maximum input length"),
    ({"input": [[1], [1] * 7]}, "prompt_too_long", "input[1]: 7 tokens"),
    ({"input": [[1], [1, 2, 100]]}, "invalid_body", "input[1][2]: token id 100 is not in the model's vocab"),
    ({"input": ["a", "b", "c", "d"]}, "invalid_body", "4 inputs exceed the limit of 3"),
    ({"input": ["a", ""]}, "invalid_body", "input[1]"),
    ({"input": []}, "invalid_body", "input"),
    ({"input": "a", "dimensions": 9}, "invalid_parameter", "dimensions: 9 exceeds the model's embedding"),
    ({"input": "a", "dimensions": 0}, "invalid_parameter", "dimensions"),
    ({"input": "a", "encoding_format": "hex"}, "invalid_parameter", "encoding_format"),
    ({"input": "a", "temperature": 0}, "invalid_parameter", "temperature"),
    ({"input": "a", "model": "other"}, "model_not_found", "the model `other` does not exist"),
    ({"input": "a", "on_deadline_miss": "reject"}, "invalid_parameter", "on_deadline_miss"),
    ({"prompt": "a"}, "invalid_body", "/v1/embeddings needs input in the body"),
])
def test_bad_embeddings_lines_name_what_is_wrong(body: dict[str, Any], code: str, fragment: str) -> None:
    error = _parse({"custom_id": "a", "url": EMBEDDINGS, "body": body})
    assert isinstance(error, LineError), error
    assert (error.line, error.code) == (5, code)
    assert fragment in error.message


def test_each_kind_of_line_is_refused_by_a_model_of_the_other_task() -> None:
    chat = _parse({"custom_id": "a", "url": CHAT, "body": {"messages": [{"role": "user", "content": "hi"}]}})
    assert isinstance(chat, LineError) and chat.code == "invalid_parameter"
    assert "the model `embedder` serves embeddings" in chat.message
    generator = replace(LIMITS, task=ModelTask("generate"))
    embed = _parse({"custom_id": "b", "url": EMBEDDINGS, "body": {"input": "hi"}}, generator)
    assert isinstance(embed, LineError) and "the model `embedder` generates text" in embed.message
    completion = _parse({"custom_id": "c", "url": COMPLETIONS, "body": {"prompt": "hi"}}, generator)
    assert isinstance(completion, BatchRequest)


def test_a_batch_of_one_endpoint_refuses_lines_of_another() -> None:
    chat_batch = replace(LIMITS, endpoint=CHAT)
    error = _parse({"custom_id": "a", "url": EMBEDDINGS, "body": {"input": "x"}}, chat_batch)
    assert isinstance(error, LineError) and error.code == "invalid_url"
    inferred = _parse({"custom_id": "b", "body": {"input": "x"}}, replace(LIMITS, endpoint=EMBEDDINGS))
    assert isinstance(inferred, BatchRequest) and inferred.kind == EMBEDDING
