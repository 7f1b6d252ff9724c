"""JSON Schemas a hostile client sends: nested past every bound (the probe's 100 object levels, 150 items)."""

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
