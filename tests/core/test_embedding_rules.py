"""The embeddings request rules every door shares (core/protocol/embedding_input.py,
core/protocol/embedding_rules.py, core/protocol/embedding_request.py): each refusal names the item, and the
vectors' stored form round-trips."""

from __future__ import annotations

import base64
import struct
from typing import Any

import pytest

from conveyor.core.protocol.embedding_input import as_inputs, input_problem
from conveyor.core.protocol.embedding_request import EmbeddingCreate, parse_embedding_body
from conveyor.core.protocol.embedding_rules import (
    EmbeddingLimits,
    embedded_tokens,
    input_lengths,
    inputs_problem,
    lengths_problem,
    task_problem,
)
from conveyor.core.protocol.model_task import ModelTask
from conveyor.core.protocol.refusal import Refusal
from conveyor.core.views.embedding_objects import EmbeddingList, embedding_list
from conveyor.core.views.embedding_vectors import decode_vector, encode_vector

LIMITS = EmbeddingLimits(max_inputs=4, vocab_size=100, max_input_tokens=8, embedding_size=32)


@pytest.mark.parametrize(("value", "inputs"), [
    ("one text", ["one text"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_each_shape_becomes_a_list_of_inputs(value: Any, inputs: list[Any]) -> None:
    assert input_problem(value) is None
    assert as_inputs(value) == inputs


@pytest.mark.parametrize(("value", "problem"), [
    ([], "input: must not be empty"),
    ("", "input: must not be an empty string"),
    (["a", ""], "input[1]: must not be an empty string"),
    ([1, "a"], "input[1]: must be a token id (an integer), got a string"),
    (["a", 1], "input[1]: must be a string, as input[0] is, got a number"),
    ([[1], "a"], "input[1]: must be a list of token ids, as input[0] is, got a string"),
    ([[1], [2, True]], "input[1][1]: must be a token id (an integer), got a boolean"),
    ([[1], []], "input[1]: must not be an empty list of token ids"),
    ([1, -1], "input[1]: token id -1 is out of range (0 to 2147483647)"),
    (["a\x00"], "input[0]: must not contain NUL (\\u0000) characters"),
    ({"text": "a"}, "input: must be a string, a list of strings, a list of token ids or a list of token-id "
                    "lists, got an object"),
    ([None], "input[0]: must be a string, a token id (an integer) or a list of token ids, got null"),
])
def test_a_bad_input_is_refused_naming_the_item(value: Any, problem: str) -> None:
    assert input_problem(value) == problem


def test_the_body_refusal_names_the_item_as_a_batch_line_error_does() -> None:
    with pytest.raises(Refusal) as caught:
        parse_embedding_body({"input": ["a", 3], "model": "m"})
    assert caught.value.param == "input[1]"
    assert caught.value.message == "input[1]: must be a string, as input[0] is, got a number"
    with pytest.raises(Refusal) as caught:
        parse_embedding_body({"input": "a", "dimensions": 0})
    assert caught.value.param == "dimensions"
    with pytest.raises(Refusal) as caught:
        parse_embedding_body({"input": "a", "encoding_format": "int8"})
    assert caught.value.param == "encoding_format"
    with pytest.raises(Refusal) as caught:
        parse_embedding_body({"input": "a", "normalize": True})
    assert caught.value.param == "normalize"  # unknown fields are refused


def test_the_job_stores_no_output_and_only_the_fields_sent() -> None:
    body = EmbeddingCreate.model_validate({"input": "a", "user": "u"})
    assert body.job_params() == {"max_tokens": 0}
    sent = EmbeddingCreate.model_validate({"input": [[1]], "dimensions": 8, "encoding_format": "base64",
                                           "truncate": True, "priority": 3})
    assert sent.job_params() == {"max_tokens": 0, "dimensions": 8, "encoding_format": "base64",
                                 "truncate": True}
    assert sent.inputs() == [[1]] and sent.queue_params() == {"priority": 3}


@pytest.mark.parametrize(("inputs", "dimensions", "field", "code"), [
    (["a"] * 5, None, "input", "too_many_inputs"),
    (["a"], 33, "dimensions", "invalid_request"),
    ([[1, 2], [3, 100]], None, "input[1][1]", "invalid_request"),
    ([[1] * 9], None, "input[0]", "input_too_long"),
    (["short", "x" * (8 * 32 + 1)], None, "input[1]", "input_too_long"),  # by its bytes, untokenized
])
def test_the_limits_before_tokenizing(inputs: list[Any], dimensions: int | None, field: str,
                                      code: str) -> None:
    problem = inputs_problem(inputs, dimensions, False, LIMITS)
    assert problem is not None and (problem.field, problem.code) == (field, code), problem
    assert problem.message.startswith(f"{field}: ")


def test_truncate_lets_a_long_input_through_and_counts_it_cut() -> None:
    assert inputs_problem([[1] * 9], None, True, LIMITS) is None
    lengths = input_lengths(["abc", [1, 2]], len)
    assert lengths == [3, 2]
    problem = lengths_problem([3, 12], False, LIMITS)
    assert problem is not None and problem.field == "input[1]"
    assert "12 tokens exceeds the model's maximum input length of 8 tokens" in problem.message
    assert "truncate" in problem.message
    assert lengths_problem([3, 12], True, LIMITS) is None
    assert embedded_tokens([3, 12], True, LIMITS) == 11 and embedded_tokens([3, 12], False, LIMITS) == 15


def test_a_request_to_a_model_of_the_other_task_says_what_it_serves() -> None:
    assert task_problem("bert", ModelTask("embed"), "embed") is None
    problem = task_problem("bert", ModelTask("embed"), "generate")
    assert problem is not None and problem.field == "model"
    assert problem.message.startswith("model: the model `bert` serves embeddings")
    problem = task_problem("llama", ModelTask("generate"), "embed")
    assert problem is not None and "`llama` generates text" in problem.message


def test_vectors_are_little_endian_float32_in_base64() -> None:
    vector = [0.5, -1.25, 3.0]
    encoded = encode_vector(vector)
    assert base64.b64decode(encoded) == struct.pack("<3f", *vector)
    assert decode_vector(encoded) == vector
    with pytest.raises(ValueError, match="float32"):
        decode_vector(base64.b64encode(b"abc").decode())


def test_the_openai_shape_in_either_format() -> None:
    stored = [encode_vector([1.0, 2.0]), encode_vector([0.25, 0.0])]
    as_floats = embedding_list(stored, None, "bert", 7)
    assert as_floats == {"object": "list", "model": "bert", "usage": {"prompt_tokens": 7, "total_tokens": 7},
                         "data": [{"object": "embedding", "index": 0, "embedding": [1.0, 2.0]},
                                  {"object": "embedding", "index": 1, "embedding": [0.25, 0.0]}]}
    as_base64 = embedding_list(stored, "base64", "bert", 7)
    assert [item["embedding"] for item in as_base64["data"]] == stored
    EmbeddingList.model_validate(as_floats)
    EmbeddingList.model_validate(as_base64)
