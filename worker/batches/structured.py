"""A batch line's structured-output fields (OpenAI's response_format, or the engine's regex / choice) ->
the job's stored `structured` param, checked as the API checks it (core/structured_rules.py)."""

from __future__ import annotations

from typing import Any

from core.structured_rules import structured_from_response_format, structured_problem

STRUCTURED_FIELDS = ("response_format", "regex", "choice")


def merge_structured(params: dict[str, Any]) -> None:
    """Replaces the fields by params["structured"] in place; ValueError naming the field."""
    sent = {name: params.pop(name) for name in STRUCTURED_FIELDS if params.get(name) is not None}
    for name in STRUCTURED_FIELDS:
        params.pop(name, None)
    if len(sent) > 1:
        raise ValueError(f"send at most one of {', '.join(STRUCTURED_FIELDS)}; got {', '.join(sent)}")
    if not sent:
        return
    [(name, value)] = sent.items()
    structured = _structured(name, value)
    if structured is None:
        return
    problem = structured_problem(structured)
    if problem is not None:
        raise ValueError(f"{name}: {problem}")
    params["structured"] = structured


def _structured(name: str, value: object) -> dict[str, Any] | None:
    if name != "response_format":
        return {name: value}
    try:
        return structured_from_response_format(value)
    except ValueError as exc:
        raise ValueError(f"response_format: {exc}") from exc
