"""A request's tools are bounded as a whole, the cheapest measure first, before pydantic builds a Tool or
any function's schema is checked (core/protocol/tool_bounds.py), by every door's model: a job, a chat
completion, a batch line. Before, 128 tools each within the bound of one schema were each checked with
jsonschema: seconds of CPU per request, on the API's event loop."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from pydantic import ValidationError

from conveyor.api.schemas.jobs import JobCreate
from conveyor.core.protocol import tools as tool_rules
from conveyor.core.protocol.openai_request import ChatCompletionCreate
from conveyor.core.protocol.structured_rules import MAX_STRUCTURED_DEPTH
from conveyor.core.protocol.tool_bounds import MAX_TOOLS, MAX_TOOLS_BYTES, MAX_TOOLS_NODES
from conveyor.core.protocol.tools import Tool
from conveyor.worker.batches.lines import CustomIdSet, LineError, LineLimits, parse_line
from tests.support.hostile_schemas import hostile_tools, nested_objects

MESSAGES = [{"role": "user", "content": "Which tool?"}]
FAST_S = 0.5  # the hostile tools took 7 s to refuse on one door, 10 s on another


def tool(name: str, parameters: dict[str, Any] | None = None, description: str = "d") -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "description": description}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def refusal(body: dict[str, Any], door: str) -> str:
    """What the door says of the body's tools: "<field>: <message>"."""
    if door == "batch line":
        line = json.dumps({"custom_id": "hostile", "body": body}).encode()
        parsed = parse_line(1, line, CustomIdSet(), LineLimits())
        assert isinstance(parsed, LineError), parsed
        return parsed.message
    model = JobCreate if door == "job" else ChatCompletionCreate
    with pytest.raises(ValidationError) as raised:
        model.model_validate(body)
    [error] = raised.value.errors()
    return f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}"


@pytest.mark.parametrize("door", ["job", "chat completion", "batch line"])
def test_the_hostile_tools_are_refused_on_every_door_in_milliseconds(door: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def never(_structured: dict[str, Any]) -> str | None:
        raise AssertionError("a tool's schema was checked before the tools' bound")

    monkeypatch.setattr(tool_rules, "structured_problem", never)
    started = time.perf_counter()
    message = refusal({"messages": MESSAGES, "tools": hostile_tools()}, door)
    assert time.perf_counter() - started < FAST_S
    assert message.startswith("tools: ") and f"at most {MAX_TOOLS_NODES} JSON objects and arrays" in message


@pytest.mark.parametrize(("tools", "expected"), [
    ([tool(f"f{n}") for n in range(MAX_TOOLS + 1)], f"at most {MAX_TOOLS} tools, got {MAX_TOOLS + 1}"),
    ([tool("a", description="x" * MAX_TOOLS_BYTES)], f"at most {MAX_TOOLS_BYTES} bytes of JSON"),
    ([tool(f"f{n}", nested_objects(MAX_STRUCTURED_DEPTH // 2 - 2)) for n in range(MAX_TOOLS)],
     f"at most {MAX_TOOLS_NODES} JSON objects and arrays"),
])
def test_each_bound_names_the_tools_and_its_limit(tools: list[dict[str, Any]], expected: str) -> None:
    message = refusal({"messages": MESSAGES, "tools": tools}, "job")
    assert message.startswith("tools: ") and expected in message, message


def test_tools_within_the_bound_are_still_judged_one_by_one() -> None:
    """A schema too deep for its own check is named at its place, as before; tools up to the bound pass."""
    deep = refusal({"messages": MESSAGES, "tools": [tool("a"), tool("b", nested_objects(16))]}, "job")
    assert f"tools[1].function.parameters: the JSON Schema is nested deeper than {MAX_STRUCTURED_DEPTH} " \
           "levels" in deep, deep
    fitting = [tool(f"f{n}", {"type": "object", "properties": {"a": {"type": "integer"}}})
               for n in range(MAX_TOOLS)]  # 128 x 4 objects: well under the bound
    assert len(JobCreate.model_validate({"messages": MESSAGES, "tools": fitting}).tools or []) == MAX_TOOLS


def test_tools_problem_bounds_the_list_it_is_given_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """chat_options' callers may build the tools themselves (vLLM's routes): the same bound comes first."""
    built = [Tool.model_validate(t) for t in hostile_tools()]
    monkeypatch.setattr(tool_rules, "structured_problem", lambda _s: "checked")
    field, reason = tool_rules.tools_problem(built, None) or ("", "")
    assert field == "tools" and f"at most {MAX_TOOLS_NODES} JSON objects and arrays" in reason
