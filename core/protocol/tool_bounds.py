"""How much a request's `tools` may hold as a whole, judged before any one tool is.

Each function's `parameters` is a JSON Schema, which jsonschema's check_schema judges at about 0.15 ms per
subschema on the API's event loop (once per door a request passes). One response_format is bounded to
MAX_STRUCTURED_NODES objects and arrays; 128 tools each that size cost seconds, spent even on a request then
refused for its prompt's length. So the tools are bounded together, as a response_format is on its own
(request_rules.json_shape_problem), the cheapest measure first: how many, then their objects and arrays
(counted iteratively, stopping at the first excess), then their bytes. This runs on the value as sent,
before pydantic builds a Tool or any schema is checked (core/protocol/tools.py: the `Tools` type).
"""

from __future__ import annotations

import json

from conveyor.core.protocol.request_rules import MAX_JSON_DEPTH, json_shape_problem, utf8_length
from conveyor.core.protocol.structured_rules import MAX_STRUCTURED_NODES

MAX_TOOLS = 128  # OpenAI's limit
# Every tool's objects and arrays together, its {"type", "function"} wrappers included: the bound of one
# response_format's schema, so that judging all the tools costs no more than judging one schema (~0.3 s).
MAX_TOOLS_NODES = MAX_STRUCTURED_NODES
MAX_TOOLS_BYTES = 256 * 1024  # compact JSON of all the tools, descriptions included
# Deeper than any tool's own check lets its parameters be (that check names the tool and its own bound),
# and shallow enough for json.dumps, which recurses, to measure the bytes.
MAX_TOOLS_DEPTH = 2 * MAX_JSON_DEPTH


def tools_bound_problem(tools: object) -> str | None:
    """Why the `tools` value as sent is too big to be judged tool by tool, or None; any other value (not a
    list) is left to the field's type."""
    if not isinstance(tools, list):
        return None
    if len(tools) > MAX_TOOLS:
        return f"at most {MAX_TOOLS} tools, got {len(tools)}"
    shape = json_shape_problem(tools, MAX_TOOLS_DEPTH, MAX_TOOLS_NODES)
    if shape is not None:
        return (f"together they may hold at most {MAX_TOOLS_NODES} JSON objects and arrays, nested at most "
                f"{MAX_TOOLS_DEPTH} levels: this list {shape}")
    size = utf8_length(json.dumps(tools, ensure_ascii=False, separators=(",", ":"), default=repr))
    if size > MAX_TOOLS_BYTES:
        return f"together they may be at most {MAX_TOOLS_BYTES} bytes of JSON, got {size}"
    return None
