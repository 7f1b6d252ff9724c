"""Structured outputs as the API and the batch lines accept them, checked without the grammar library.

The engine compiles with xgrammar, which imports torch, so the API cannot. Here: OpenAI's `response_format`
becomes the engine's stored form ({"json_schema": {...}} | {"json_object": true} | {"regex": "..."} |
{"choice": [...]}), a schema must pass its JSON Schema meta-schema and fit MAX_STRUCTURED_BYTES. A schema
that passes but that xgrammar still cannot compile fails the job with code invalid_request.

jsonschema's check_schema recurses about nine Python frames per level of JSON and costs about 0.15 ms per
subschema, on the API's event loop: so the value's depth and its count of objects and arrays are bounded
first, iteratively, and a check that still recurses too far (a `pattern` of a thousand nested groups, which
Python's regex parser compiles recursively) is a refusal, not an error.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from conveyor.core.protocol.request_rules import MAX_JSON_DEPTH, json_problem, json_shape_problem

# Must equal the engine's MAX_STRUCTURED_BYTES (engine/structured_output/constraint.py; core cannot import the
# engine, a test checks they agree).
MAX_STRUCTURED_BYTES = 64 * 1024
MAX_CHOICES = 1024
# A schema is stored two levels down in the job's params (params.structured.json_schema), which must stay
# within MAX_JSON_DEPTH: 30 levels of JSON, 15 of nested object schemas, ~300 frames to check.
MAX_STRUCTURED_DEPTH = MAX_JSON_DEPTH - 2
MAX_STRUCTURED_NODES = 2048  # objects and arrays; checking that many subschemas takes ~0.3 s at worst
MAX_SCHEMA_ERROR_CHARS = 300  # a SchemaError's message quotes the offending value, which may be 64 KiB
_LABELS = {"json_schema": "the JSON Schema", "json_object": "json_object", "regex": "regex",
           "choice": "choice"}
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def structured_from_response_format(response_format: object) -> dict[str, Any] | None:
    """OpenAI's response_format -> the stored structured form (None for text). ValueError saying why."""
    if not isinstance(response_format, dict):
        raise ValueError(f"must be an object with a type, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise ValueError(f"type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise ValueError("json_schema.schema must be a JSON Schema object")
    return {"json_schema": spec["schema"]}


def structured_problem(structured: dict[str, Any]) -> str | None:
    """Why the stored structured form cannot be run, or None."""
    set_kinds = [k for k, v in structured.items() if v is not None and v is not False]
    if len(set_kinds) != 1:
        return f"exactly one of json_schema, json_object, regex, choice must be set, got {set_kinds}"
    kind = set_kinds[0]
    value = structured[kind]
    label = _LABELS.get(kind, kind)
    shape = json_shape_problem(value, MAX_STRUCTURED_DEPTH, MAX_STRUCTURED_NODES)
    if shape is not None:  # before anything recursive (json.dumps, jsonschema) sees it
        return f"{label} {shape}"
    stored = json_problem(value)  # stored in the job's params: no NUL, no lone surrogates, finite numbers
    if stored is not None:
        return f"{label} {stored}"
    size = len(json.dumps([kind, value], sort_keys=True, separators=(",", ":")).encode())
    if size > MAX_STRUCTURED_BYTES:
        return f"must be at most {MAX_STRUCTURED_BYTES} bytes of canonical JSON, got {size}"
    return _kind_problem(kind, value)


def _kind_problem(kind: str, value: object) -> str | None:
    if kind == "json_schema":
        return _schema_problem(value)
    if kind == "json_object":
        return None if value is True else "json_object must be true"
    if kind == "regex":
        return None if isinstance(value, str) and value else "regex must be a non-empty string"
    if kind == "choice":
        ok = isinstance(value, list) and 0 < len(value) <= MAX_CHOICES
        if not ok or not all(isinstance(c, str) and c for c in value):  # type: ignore[union-attr]
            return f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings"
        return None
    return f"unknown kind {kind!r}"


def _schema_problem(schema: object) -> str | None:
    if not isinstance(schema, dict):
        return "the JSON Schema must be an object"
    draft = schema.get("$schema")
    if draft is not None and not isinstance(draft, str):
        return f"$schema must be a string naming a JSON Schema draft, got {type(draft).__name__}"
    try:
        # An unknown $schema is checked as the latest draft (without jsonschema's deprecation warning).
        validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    except ValueError:  # $schema is not a URI jsonschema can split ("http://[")
        return "$schema must be a URI naming a JSON Schema draft"
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        return f"not a valid JSON Schema: {_shortened(exc.message)}"
    except RecursionError:  # e.g. a pattern of deeply nested groups, compiled by Python's recursive parser
        return "the JSON Schema is too deeply nested to check (a pattern with deeply nested groups?)"
    return None


def _shortened(message: str) -> str:
    if len(message) <= MAX_SCHEMA_ERROR_CHARS:
        return message
    return message[:MAX_SCHEMA_ERROR_CHARS] + "..."
