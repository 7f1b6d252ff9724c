"""The limits an embeddings request is held to, whichever way it came in (POST /v1/embeddings, a job of kind
embedding, a batch line): each rule returns the `FieldProblem` naming the item, or None, and each door
answers it its own way (422 on /v1/jobs, 400 on the OpenAI route, a line error in a batch).

Judged in two steps, as prompts are (core/protocol/request_limits.py), so that a request that cannot run costs
no tokenization:
1. `inputs_problem`, before tokenizing: how many inputs, token ids within the model's vocabulary, token-id
   inputs and (by their bytes) text inputs no longer than the model embeds, `dimensions` within its vectors;
2. `lengths_problem`, once the text inputs are tokenized (with the tokenizer's special tokens, as
   sentence-transformers does): each input no longer than the model embeds, unless `truncate` asks that it
   be cut to that length.
And before both, `task_problem`: a request of one kind to a model that serves the other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from conveyor.core.protocol.field_errors import FieldProblem
from conveyor.core.protocol.model_limits import served_max_model_len
from conveyor.core.protocol.model_task import ModelTask, Task
from conveyor.core.protocol.request_rules import PROMPT_BYTES_PER_TOKEN, utf8_length
from conveyor.core.settings import Settings

Inputs = list[str | list[int]]


@dataclass(frozen=True)
class EmbeddingLimits:
    """What an embeddings request is held to: the inputs a request may hold (Settings.max_embedding_inputs),
    and what the model knows (None: not known, not judged): its vocabulary, its longest input in tokens and
    its vectors' size."""

    max_inputs: int
    vocab_size: int | None = None
    max_input_tokens: int | None = None
    embedding_size: int | None = None

    @classmethod
    def of_model(cls, settings: Settings, task: ModelTask, tokenizer_vocab: int | None) -> EmbeddingLimits:
        """The limits of an embedding model (`settings` as it sees them): its longest input is the configured
        max_model_len within the one it embeds; its vocabulary its config's, else its tokenizer's."""
        return cls(settings.max_embedding_inputs, task.vocab_size or tokenizer_vocab,
                   served_max_model_len(settings.max_model_len, task.max_input_tokens), task.embedding_size)


def task_problem(model_id: str, task: ModelTask, wanted: Task) -> FieldProblem | None:
    """A request of the kind `wanted` to a model that serves the other: the message says what it serves."""
    if task.task == wanted:
        return None
    message = f"model: the model `{model_id}` {task.serves()}"
    return FieldProblem("model", "wrong_model_task", message, "invalid_parameter", message)


def inputs_problem(inputs: Inputs, dimensions: int | None, truncate: bool, limits: EmbeddingLimits,
                   ) -> FieldProblem | None:
    """What is judged before tokenizing (the module docstring's first step)."""
    return (_count_problem(inputs, limits) or _dimensions_problem(dimensions, limits)
            or next((p for i, item in enumerate(inputs) if (p := _item_problem(i, item, truncate, limits))),
                    None))


def lengths_problem(lengths: list[int], truncate: bool, limits: EmbeddingLimits) -> FieldProblem | None:
    """Each input's tokens against the longest the model embeds (the second step); none with truncate."""
    longest = limits.max_input_tokens
    if truncate or longest is None:
        return None
    index = next((i for i, length in enumerate(lengths) if length > longest), None)
    return None if index is None else _too_long(index, f"{lengths[index]} tokens", longest)


def input_lengths(inputs: Inputs, count_text: Callable[[str], int]) -> list[int]:
    """Each input's tokens: a text counted by `count_text` (the model's tokenizer, special tokens
    included), a list of token ids as it is."""
    return [count_text(item) if isinstance(item, str) else len(item) for item in inputs]


def embedded_tokens(lengths: list[int], truncate: bool, limits: EmbeddingLimits) -> int:
    """The prompt tokens the inputs will be (a job's usage): with truncate, each at most the longest."""
    longest = limits.max_input_tokens
    if not truncate or longest is None:
        return sum(lengths)
    return sum(min(length, longest) for length in lengths)


def _count_problem(inputs: Inputs, limits: EmbeddingLimits) -> FieldProblem | None:
    if len(inputs) <= limits.max_inputs:
        return None
    message = f"input: {len(inputs)} inputs exceed the limit of {limits.max_inputs} per request"
    return FieldProblem("input", "too_many_inputs", message, "invalid_body", message)


def _dimensions_problem(dimensions: int | None, limits: EmbeddingLimits) -> FieldProblem | None:
    size = limits.embedding_size
    if dimensions is None or size is None or dimensions <= size:
        return None
    message = f"dimensions: {dimensions} exceeds the model's embedding size ({size})"
    return FieldProblem("dimensions", "invalid_request", message, "invalid_parameter", message)


def _item_problem(index: int, item: str | list[int], truncate: bool, limits: EmbeddingLimits,
                  ) -> FieldProblem | None:
    if isinstance(item, list):
        return _vocab_problem(index, item, limits) or _token_ids_length_problem(index, item, truncate, limits)
    longest = limits.max_input_tokens
    if truncate or longest is None or utf8_length(item) <= longest * PROMPT_BYTES_PER_TOKEN:
        return None
    return _too_long(index, f"{utf8_length(item)} bytes (over {PROMPT_BYTES_PER_TOKEN} per token)", longest)


def _vocab_problem(index: int, ids: list[int], limits: EmbeddingLimits) -> FieldProblem | None:
    vocab = limits.vocab_size
    position = next((i for i, token in enumerate(ids) if vocab is not None and token >= vocab), None)
    if position is None:
        return None
    assert vocab is not None
    message = (f"input[{index}][{position}]: token id {ids[position]} is not in the model's vocabulary "
               f"(0 to {vocab - 1})")
    return FieldProblem(f"input[{index}][{position}]", "invalid_request", message, "invalid_body", message)


def _token_ids_length_problem(index: int, ids: list[int], truncate: bool, limits: EmbeddingLimits,
                              ) -> FieldProblem | None:
    longest = limits.max_input_tokens
    if truncate or longest is None or len(ids) <= longest:
        return None
    return _too_long(index, f"{len(ids)} tokens", longest)


def _too_long(index: int, size: str, longest: int) -> FieldProblem:
    field = f"input[{index}]"
    message = (f"{field}: {size} exceeds the model's maximum input length of {longest} tokens; shorten it, "
               "or send `truncate: true` to embed its first tokens only")
    return FieldProblem(field, "input_too_long", message, "prompt_too_long", message)
