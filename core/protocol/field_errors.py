"""A refused field as one "field: what is wrong" line naming the field as a client wrote it
(`messages[0].content`): pydantic's validation errors, and the `FieldProblem` the request rules return (core/
request_limits.py). Shared by the API's error handlers and the batch line parser, so a refused field reads
the same over HTTP and in a batch's error file."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from conveyor.core.protocol.request_rules import SURROGATE, text_problem

LOCATIONS = ("body", "query", "path", "header", "cookie")
_LEADING_FIELD = re.compile(r"^([A-Za-z_][\w]*(?:\[\d+\]|\.[A-Za-z_]\w*)*): ")
UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "url", "none"})


@dataclass(frozen=True)
class FieldProblem:
    """Why a request cannot run, naming `field`: the API answers `code` and `message` (422 on /v1/jobs,
    OpenAI's 400 on its routes); a batch line fails with `line_code` and `line_message`, the batch error
    file's own codes (invalid_parameter, ...). Both messages start with the field."""

    field: str
    code: str
    message: str
    line_code: str
    line_message: str


def validation_message(errors: Sequence[Any]) -> tuple[str | None, str]:
    """(field, "field: what is wrong") for the most telling of pydantic's errors."""
    error = _most_specific(errors)
    field = field_name(error.get("loc", ()))
    if not field and error.get("type") == "string_unicode":  # pydantic names no field for such a key
        return None, f"a field name {SURROGATE}"
    if not field:  # a whole-body rule (a model validator) names its field first: "max_tokens: ..."
        message = str(error.get("msg"))
        named = _LEADING_FIELD.match(message)
        return (named.group(1) if named else None), message
    message = str(error.get("msg", "invalid value"))
    named = _LEADING_FIELD.match(message)
    if named and named.group(1).startswith(f"{field}["):  # a validator that names the item: `input[2]: ...`
        return named.group(1), message
    if named and named.group(1) == field:  # a validator that names its field already: `input: ...`
        return field, message
    return field, f"{field}: {message}"


def _most_specific(errors: Sequence[Any]) -> dict[str, Any]:
    """The first error, unless it is a union member's type mismatch and a later error about the same field
    says what is wrong: `"stop": ["\\udfff"]` fails as a string too, but the news is its bad item."""
    first: dict[str, Any] = errors[0]
    if not str(first.get("type", "")).endswith("_type"):
        return first
    field = field_name(first.get("loc", ()))
    for error in errors[1:]:
        name = field_name(error.get("loc", ()))
        same_field = name == field or name.startswith((f"{field}[", f"{field}."))
        if same_field and not str(error.get("type", "")).endswith("_type"):
            return dict(error)
    return first


def untagged(loc: tuple[Any, ...] | list[Any]) -> tuple[Any, ...]:
    """`loc` without the tag of the request model a body was judged as, when the body is a tagged union of
    models (POST /v1/jobs: ('body', 'EmbeddingJobCreate', 'input') -> ('body', 'input')). The tags are the
    models' names; a body's own fields are never capitalised."""
    parts = tuple(loc)
    if len(parts) > 1 and parts[0] == "body" and isinstance(parts[1], str) and _is_model_tag(parts[1]):
        return (parts[0], *parts[2:])
    return parts


def _is_model_tag(part: str) -> bool:
    return part[:1].isupper() and part.isidentifier()


def field_name(loc: tuple[Any, ...] | list[Any]) -> str:
    """('body', 'messages', 0, 'content') -> 'messages[0].content'; union member tags are dropped, and a key
    that is not storable text (an unknown field named with a NUL) is shown escaped."""
    loc = untagged(loc)
    parts = list(loc[1:] if loc and loc[0] in LOCATIONS else loc)
    out = _shown(parts[0]) if parts else ""
    for part in parts[1:]:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_union_tag(str(part)):
            out += f".{_shown(part)}"
    return out


def _shown(part: object) -> str:
    text = str(part)
    return text if text_problem(text) is None else ascii(text)


def _is_union_tag(part: str) -> bool:
    """pydantic names the failing member of a union in loc: 'str', 'list[constrained-str]', 'WebhookSpec'."""
    return "[" in part or "-" in part or part in UNION_TAGS or part[:1].isupper()
