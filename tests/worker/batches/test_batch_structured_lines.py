"""Batch lines with structured outputs: stored as the job's `structured` param; a bad one is a line error."""

from __future__ import annotations

import json
from typing import Any

import pytest

from conveyor.worker.batches.lines import BatchRequest, CustomIdSet, LineError, parse_line
from conveyor.worker.sampling import sampling_params_from_json

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def _parse(body: dict[str, Any]) -> BatchRequest | LineError:
    line = {"custom_id": "x", "body": {"prompt": "hi", **body}}
    return parse_line(5, json.dumps(line).encode(), CustomIdSet())


@pytest.mark.parametrize(("body", "stored"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}},
     {"json_schema": SCHEMA}),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"regex": "[a-z]+"}, {"regex": "[a-z]+"}),
    ({"choice": ["a", "b"]}, {"choice": ["a", "b"]}),
])
def test_structured_line_is_stored_and_builds_sampling_params(body: dict[str, Any], stored: Any) -> None:
    request = _parse(body)
    assert isinstance(request, BatchRequest), request
    assert request.params["structured"] == stored
    params = sampling_params_from_json(request.params)
    assert params.structured is not None and params.structured.kind == next(iter(stored))


def test_text_response_format_is_unconstrained() -> None:
    request = _parse({"response_format": {"type": "text"}})
    assert isinstance(request, BatchRequest) and "structured" not in request.params


@pytest.mark.parametrize(("body", "word"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"regex": "a", "choice": ["a"]}, "at most one"),
    ({"choice": []}, "choice"),
])
def test_bad_structured_line_is_a_line_error_with_its_number(body: dict[str, Any], word: str) -> None:
    error = _parse(body)
    assert isinstance(error, LineError) and error.line == 5 and word in error.message, error
