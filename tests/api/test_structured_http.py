"""Structured outputs at submit: stored as the engine's `structured` param, bad ones 422 naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from conveyor.api.schemas.jobs import JobCreate
from conveyor.core.protocol.structured_rules import MAX_STRUCTURED_BYTES
from conveyor.engine.structured_output.constraint import MAX_STRUCTURED_BYTES as ENGINE_MAX_STRUCTURED_BYTES
from tests.support.service import error_of

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_core_and_engine_share_the_size_limit() -> None:
    assert MAX_STRUCTURED_BYTES == ENGINE_MAX_STRUCTURED_BYTES


@pytest.mark.parametrize(("body", "stored"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
     {"json_schema": SCHEMA}),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "text"}}, None),
    ({"regex": "[0-9]+"}, {"regex": "[0-9]+"}),
    ({"choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
])
def test_structured_fields_are_stored(alice: TestClient, body: dict[str, Any], stored: Any) -> None:
    assert JobCreate.model_validate({"prompt": "x", **body}).sampling_params().get("structured") == stored
    r = alice.post("/v1/jobs", json={"prompt": "x", **body})
    assert r.status_code in (200, 201, 202), r.text


@pytest.mark.parametrize(("body", "field"), [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object", "description": "x" * MAX_STRUCTURED_BYTES}}}}, "response_format"),
    ({"regex": ""}, "regex"),
    ({"choice": []}, "choice"),
    ({"regex": "a", "choice": ["a"]}, "choice"),
    ({"response_format": {"type": "json_object"}, "regex": "a"}, "regex"),
])
def test_bad_structured_output_is_422_naming_the_field(
    alice: TestClient, body: dict[str, Any], field: str
) -> None:
    r = alice.post("/v1/jobs", json={"prompt": "x", **body})
    assert r.status_code == 422, r.text
    error = error_of(r)
    assert error["field"] == field, error
