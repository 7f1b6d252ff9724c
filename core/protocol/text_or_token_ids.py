"""The shapes OpenAI's embeddings `input` and completions `prompt` take, judged item by item so a refusal
names the item: one string, a list of strings, one list of token ids, or a list of token-id lists. Every
shape becomes a list of items, each a string or a list of token ids (`as_items`)."""

from __future__ import annotations

from conveyor.core.protocol.request_fields import MAX_INT32
from conveyor.core.protocol.request_rules import text_problem

TextOrTokenIds = str | list[int]  # one item: a text, or the token ids of one
SHAPES = "a string, a list of strings, a list of token ids or a list of token-id lists"


def items_problem(field: str, value: object) -> str | None:
    """Why `value` is not a valid `field`, as "<where>: <reason>" (`input[2]: must not be an empty string`),
    or None. The first item of a list says what the others must be."""
    if isinstance(value, str):
        return _text_problem(field, value)
    if not isinstance(value, list):
        return f"{field}: must be {SHAPES}, got {_kind(value)}"
    if not value:
        return f"{field}: must not be empty"
    first = value[0]
    if is_token_id(first):
        return _token_ids_problem(field, value)
    if isinstance(first, str):
        return _each_problem(field, value, str, "a string")
    if isinstance(first, list):
        return _each_problem(field, value, list, "a list of token ids")
    return f"{field}[0]: must be a string, a token id (an integer) or a list of token ids, got {_kind(first)}"


def as_items(value: str | list[int] | list[str] | list[list[int]]) -> list[TextOrTokenIds]:
    """The items of a valid value (items_problem None): a string or a list of token ids is one."""
    if not is_listed(value):
        return [value]  # type: ignore[list-item]
    return list(value)  # type: ignore[arg-type]


def is_listed(value: object) -> bool:
    """Whether `value` was sent as a list of items (strings or token-id lists), rather than as one item: its
    items are then named `field[i]`."""
    return isinstance(value, list) and bool(value) and not is_token_id(value[0])


def is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _each_problem(field: str, items: list[object], kind: type, described: str) -> str | None:
    for index, item in enumerate(items):
        where = f"{field}[{index}]"
        if not isinstance(item, kind):
            return f"{where}: must be {described}, as {field}[0] is, got {_kind(item)}"
        problem = _text_problem(where, item) if isinstance(item, str) else _token_ids_problem(where, item)
        if problem is not None:
            return problem
    return None


def _token_ids_problem(where: str, ids: list[object]) -> str | None:
    if not ids:
        return f"{where}: must not be an empty list of token ids"
    for index, token in enumerate(ids):
        if not is_token_id(token):
            return f"{where}[{index}]: must be a token id (an integer), got {_kind(token)}"
        if not 0 <= token <= MAX_INT32:  # type: ignore[operator]
            return f"{where}[{index}]: token id {token} is out of range (0 to {MAX_INT32})"
    return None


def _text_problem(where: str, text: str) -> str | None:
    if not text:
        return f"{where}: must not be an empty string"
    problem = text_problem(text)
    return f"{where}: {problem}" if problem is not None else None


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
