"""OpenAI's embeddings `input`: one string, a list of strings, one list of token ids, or a list of token-id
lists (core/protocol/text_or_token_ids.py, the shapes completions' `prompt` takes too), judged item by item
so a refusal names the item (`input[2]`). Every shape becomes the job's list of inputs, each a string or a
list of token ids (`as_inputs`)."""

from __future__ import annotations

from conveyor.core.protocol.text_or_token_ids import TextOrTokenIds, as_items, items_problem

FIELD = "input"


def input_problem(value: object) -> str | None:
    """Why `value` is not an `input`, as "<where>: <reason>" (`input[2]: must not be an empty string`), or
    None."""
    return items_problem(FIELD, value)


def as_inputs(value: str | list[int] | list[str] | list[list[int]]) -> list[TextOrTokenIds]:
    """The job's inputs of a valid `input` (input_problem None): a string or a list of token ids is one."""
    return as_items(value)
