"""Structured-output schemas are judged without ever raising: depth and size are bounded iteratively before
jsonschema's recursive check_schema sees them, and whatever still passes is checked with room to spare on the
stack. Before, an object schema nested 100 levels (or `items` nested 150) raised RecursionError: a 500."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

from conveyor.core.protocol.request_rules import json_shape_problem
from conveyor.core.protocol.structured_rules import (
    MAX_SCHEMA_ERROR_CHARS,
    MAX_STRUCTURED_DEPTH,
    MAX_STRUCTURED_NODES,
    structured_problem,
)
from tests.support.hostile_schemas import nested_items, nested_objects

DRAFTS = [
    "https://json-schema.org/draft/2020-12/schema", "https://json-schema.org/draft/2019-09/schema",
    "http://json-schema.org/draft-07/schema#", "http://json-schema.org/draft-06/schema#",
    "http://json-schema.org/draft-04/schema#", "http://json-schema.org/draft-03/schema#",
]
# Keywords whose value is one subschema (one level of JSON per level of schema) or holds subschemas one
# level further down (an object of them, or an array of them).
ONE_LEVEL = ["items", "not", "if", "then", "else", "contains", "propertyNames", "additionalProperties",
             "additionalItems", "unevaluatedItems", "unevaluatedProperties", "contentSchema"]
IN_AN_OBJECT = ["properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"]
IN_AN_ARRAY = ["allOf", "anyOf", "oneOf", "prefixItems"]


def deepest(keyword: str) -> dict[str, Any]:
    """The deepest schema the depth bound lets through, nesting `keyword` all the way down."""
    schema: dict[str, Any] = {}
    depth = 1
    step = 1 if keyword in ONE_LEVEL else 2
    while depth + step <= MAX_STRUCTURED_DEPTH:
        if keyword in ONE_LEVEL:
            schema = {keyword: schema}
        elif keyword in IN_AN_ARRAY:
            schema = {keyword: [schema]}
        else:
            schema = {keyword: {"a": schema}}
        depth += step
    return schema


def with_frames_used(frames: int, call: Callable[[], Any]) -> Any:
    """`call()` run `frames` Python frames below the current one: what the API or a batch runner may already
    have on the stack when it checks a schema."""
    if frames == 0:
        return call()
    return with_frames_used(frames - 1, call)


@pytest.mark.parametrize("schema", [nested_objects(100), nested_items(150),
                                    nested_items(MAX_STRUCTURED_DEPTH)])
def test_deep_schema_is_refused_naming_the_depth(schema: dict[str, Any]) -> None:
    assert structured_problem({"json_schema": schema}) == (
        f"the JSON Schema is nested deeper than {MAX_STRUCTURED_DEPTH} levels")


def test_nesting_far_past_the_recursion_limit_is_judged_iteratively() -> None:
    schema = nested_items(sys.getrecursionlimit() * 20)
    assert "nested deeper" in str(structured_problem({"json_schema": schema}))
    assert json_shape_problem([[[]]], max_depth=3) is None
    assert json_shape_problem([[[[]]]], max_depth=3) == "is nested deeper than 3 levels"


@pytest.mark.parametrize("draft", DRAFTS)
@pytest.mark.parametrize("keyword", ONE_LEVEL + IN_AN_OBJECT + IN_AN_ARRAY)
def test_deepest_allowed_schema_checks_with_the_stack_half_used(draft: str, keyword: str) -> None:
    """check_schema takes about nine frames per level of JSON; at the depth bound it needs ~330 of the 1,000
    Python allows, so it passes with 500 frames already used (an API request's stack holds about 100). A
    keyword a draft does not know is no schema to it, and a draft may refuse a form (2020-12's `items` takes
    one schema, not a list): a refusal, not an exception, either way."""
    schema = {"$schema": draft, **deepest(keyword)}
    assert json_shape_problem(schema, MAX_STRUCTURED_DEPTH) is None
    problem = with_frames_used(500, lambda: structured_problem({"json_schema": schema}))
    assert problem is None or problem.startswith("not a valid JSON Schema"), problem


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},
    {"type": "object", "properties": {"next": {"$ref": "#"}}},
    {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
    {"$schema": "http://json-schema.org/draft-04/schema#", "$ref": "#/definitions/a",
     "definitions": {"a": {"$ref": "#/definitions/a"}}},
    {"$dynamicRef": "#", "$dynamicAnchor": "a"},
])
def test_reference_cycles_are_not_followed(schema: dict[str, Any]) -> None:
    """check_schema validates the schema against its meta-schema and never resolves the schema's own $refs."""
    assert structured_problem({"json_schema": schema}) is None


def test_node_count_is_bounded() -> None:
    at_the_bound = {"anyOf": [{}] * (MAX_STRUCTURED_NODES - 2)}  # the root and its list count too
    assert structured_problem({"json_schema": at_the_bound}) is None
    over = {"anyOf": [{}] * (MAX_STRUCTURED_NODES - 1)}
    assert structured_problem({"json_schema": over}) == (
        f"the JSON Schema holds more than {MAX_STRUCTURED_NODES} objects and arrays")


@pytest.mark.parametrize(("schema", "fragment"), [
    ({"$schema": []}, "$schema must be a string"),
    ({"$schema": {"a": 1}}, "$schema must be a string"),
    ({"$schema": 5}, "$schema must be a string"),
    ({"$schema": "http://["}, "$schema must be a URI"),
    ({"type": "string", "pattern": "(" * 2000 + ")" * 2000}, "too deeply nested to check"),
    ({"patternProperties": {"(" * 2000 + ")" * 2000: {}}}, "too deeply nested to check"),
    ({"description": "a\x00b"}, 'the JSON Schema ["description"]: must not contain NUL'),
    ({"description": "\udfff"}, 'the JSON Schema ["description"]: must be valid Unicode'),
    ({"maximum": float("nan")}, 'the JSON Schema ["maximum"]: must be a finite number'),
    ({"type": 5}, "not a valid JSON Schema"),
])
def test_hostile_schema_is_a_refusal_not_an_exception(schema: dict[str, Any], fragment: str) -> None:
    problem = structured_problem({"json_schema": schema})
    assert problem is not None and fragment in problem, problem


def test_unknown_draft_is_checked_as_the_latest_without_a_warning() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schema = {"$schema": "https://example.com/mine", "type": "object"}
        assert structured_problem({"json_schema": schema}) is None


def test_schema_error_quoting_a_huge_value_is_shortened() -> None:
    problem = structured_problem({"json_schema": {"properties": list(range(5000))}})
    assert problem is not None and problem.startswith("not a valid JSON Schema: ")
    assert len(problem) <= len("not a valid JSON Schema: ") + MAX_SCHEMA_ERROR_CHARS + 3


@pytest.mark.parametrize("structured", [{"regex": "a\x00"}, {"choice": ["\udfff"]}])
def test_other_kinds_hold_storable_text(structured: dict[str, Any]) -> None:
    assert structured_problem(structured) is not None


def test_check_schema_agrees_on_what_passes() -> None:
    """A schema that passes is one jsonschema itself accepts."""
    schema = nested_objects(MAX_STRUCTURED_DEPTH // 2 - 1)
    assert structured_problem({"json_schema": schema}) is None
    jsonschema.Draft202012Validator.check_schema(schema)
