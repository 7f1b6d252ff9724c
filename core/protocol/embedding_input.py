"""The shapes OpenAI's embeddings `input` takes, judged item by item so a refusal names the item: one string,
a list of strings, one list of token ids, or a list of token-id lists. Every shape becomes the job's list of
inputs, each a string or a list of token ids (`as_inputs`)."""

from __future__ import annotations

from conveyor.core.protocol.request_fields import MAX_INT32
from conveyor.core.protocol.request_rules import text_problem

EmbeddingInput = str | list[int] | list[str | list[int]]  # the job's form: list[str | list[int]]
SHAPES = "a string, a list of strings, a list of token ids or a list of token-id lists"


def input_problem(value: object) -> str | None:
    """Why `value` is not an `input`, as "<where>: <reason>" (`input[2]: must not be an empty string`), or
    None. The first item of a list says what the others must be."""
    if isinstance(value, str):
        return _text_problem("input", value)
    if not isinstance(value, list):
        return f"input: must be {SHAPES}, got {_kind(value)}"
    if not value:
        return "input: must not be empty"
    first = value[0]
    if _is_token_id(first):
        return _token_ids_problem("input", value)
    if isinstance(first, str):
        return _items_problem(value, str, "a string")
    if isinstance(first, list):
        return _items_problem(value, list, "a list of token ids")
    return f"input[0]: must be a string, a token id (an integer) or a list of token ids, got {_kind(first)}"


def as_inputs(value: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """The job's inputs of a valid `input` (input_problem None): a string or a list of token ids is one."""
    if isinstance(value, str) or (value and _is_token_id(value[0])):
        return [value]  # type: ignore[list-item]
    return list(value)  # type: ignore[arg-type]


def _items_problem(items: list[object], kind: type, described: str) -> str | None:
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, kind):
            return f"{where}: must be {described}, as input[0] is, got {_kind(item)}"
        problem = _text_problem(where, item) if isinstance(item, str) else _token_ids_problem(where, item)
        if problem is not None:
            return problem
    return None


def _token_ids_problem(where: str, ids: list[object]) -> str | None:
    if not ids:
        return f"{where}: must not be an empty list of token ids"
    for index, token in enumerate(ids):
        if not _is_token_id(token):
            return f"{where}[{index}]: must be a token id (an integer), got {_kind(token)}"
        if not 0 <= token <= MAX_INT32:  # type: ignore[operator]
            return f"{where}[{index}]: token id {token} is out of range (0 to {MAX_INT32})"
    return None


def _text_problem(where: str, text: str) -> str | None:
    if not text:
        return f"{where}: must not be an empty string"
    problem = text_problem(text)
    return f"{where}: {problem}" if problem is not None else None


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: object) -> str:
    """The JSON type of a parsed value, as a client wrote it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object" if isinstance(value, dict) else type(value).__name__
