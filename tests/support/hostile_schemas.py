"""JSON Schemas a hostile client sends: nested past every bound (the probe's 100 object levels, 150 items),
and tools each within the bound of one schema but far past it together."""

from __future__ import annotations

from typing import Any


def nested_objects(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def nested_items(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


def hostile_tools(count: int = 128, parameters: int = 12) -> list[dict[str, Any]]:
    """The issue's tools: 128 functions (OpenAI's limit), each with 12 object-typed parameters of 8
    properties; each schema is well under the bound of one response_format, all of them together about
    360 KB and 16,000 objects and arrays."""
    def parameter() -> dict[str, Any]:
        return {"type": "object", "properties": {f"f{i}": {"type": "string"} for i in range(8)}}

    return [{"type": "function", "function": {
        "name": f"tool_{n}", "description": "Does one thing.",
        "parameters": {"type": "object", "properties": {f"p{p}": parameter() for p in range(parameters)}}}}
        for n in range(count)]
