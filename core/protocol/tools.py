"""Tool calling as OpenAI's chat API has it: the `tools` a request offers, its `tool_choice`, and the grammar
that makes a call certain to parse.

A request's tools are rendered by the model's own chat template (its `tools` variable). With `tool_choice`
`auto` the model decides and its text is read by the tool parser (core/views/tool_calls.py). With `required`
or a named function the output is constrained, like any structured output, to a JSON schema built here from
the functions' parameter schemas, so the arguments always parse and validate:
- `required`: `[{"name": <one of the functions>, "arguments": {...}}, ...]` (one item when
  parallel_tool_calls is false);
- a named function: its arguments object alone.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from conveyor.core.protocol.request_fields import StoredText, StrictFlag
from conveyor.core.protocol.structured_rules import structured_problem
from conveyor.core.protocol.tool_bounds import MAX_TOOLS, tools_bound_problem

FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names
ToolChoiceMode = Literal["none", "auto", "required"]
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]
    description: StoredText | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of the arguments object")
    strict: StrictFlag | None = Field(None, description="accepted; arguments always follow the schema "
                                      "when the call is constrained (tool_choice required or named)")

    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else EMPTY_PARAMETERS


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionName


def _bounded(tools: object) -> object:
    """The tools as sent, refused before pydantic builds a Tool when they are too big as a whole."""
    problem = tools_bound_problem(tools)
    if problem is not None:
        raise PydanticCustomError("tools_too_large", problem)
    return tools


# The whole-list bound wraps the list's own validation, so it runs first on every door that takes tools
# (POST /v1/jobs, /v1/chat/completions, vLLM's routes, batch lines).
Tools = Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS), BeforeValidator(_bounded)]
ToolChoice = ToolChoiceMode | NamedToolChoice


def tools_problem(tools: list[Tool] | None, choice: ToolChoice | None) -> tuple[str, str] | None:
    """(field, reason) for tools or a tool_choice that cannot run, else None. The tools as a whole are
    bounded before any one is judged."""
    if tools is not None:
        bound = tools_bound_problem([tool.model_dump(mode="json", exclude_none=True) for tool in tools])
        if bound is not None:
            return "tools", bound
    names = [tool.function.name for tool in tools or []]
    for index, tool in enumerate(tools or []):
        if names.index(tool.function.name) != index:
            return f"tools[{index}].function.name", f"{tool.function.name!r} is named twice"
        problem = structured_problem({"json_schema": tool.function.arguments_schema()})
        if problem is not None:
            return f"tools[{index}].function.parameters", problem
    if choice is None or choice == "none":
        return None
    if not names:
        return "tool_choice", "needs tools"
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        return "tool_choice", f"names {choice.function.name!r}, which is not one of the tools"
    return None


def choice_json(choice: ToolChoice | None, tools: list[Tool] | None) -> str | dict[str, Any]:
    """tool_choice as stored: OpenAI's default is `auto` with tools and `none` without."""
    if choice is None:
        return "auto" if tools else "none"
    return choice.model_dump(mode="json") if isinstance(choice, NamedToolChoice) else choice


def constrained_schema(tools: list[dict[str, Any]], choice: str | dict[str, Any], parallel: bool,
                       ) -> dict[str, Any] | None:
    """The JSON schema the output must follow for a stored tool_choice: None for `none` and `auto`."""
    functions = {tool["function"]["name"]: tool["function"] for tool in tools}
    if isinstance(choice, dict):
        return _arguments(functions[choice["function"]["name"]])
    if choice != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": _arguments(function)},
              "required": ["name", "arguments"], "additionalProperties": False}
             for name, function in functions.items()]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _arguments(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters")
    return parameters if parameters is not None else EMPTY_PARAMETERS


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]
    arguments: StoredText = Field(description="a JSON object's text, as a tool call's answer has it")


class ToolCallIn(BaseModel):
    """A call an earlier assistant message made, sent back in the history."""

    model_config = ConfigDict(extra="forbid")

    id: StoredText
    type: Literal["function"]
    function: CalledFunction


def history_problem(messages: list[dict[str, Any]]) -> tuple[str, str] | None:
    """(field, reason) for a message the chat template could not be given: tool calls on a message that
    is not the assistant's, arguments that are not a JSON object, a message with neither content nor
    tool calls."""
    for index, message in enumerate(messages):
        calls = message.get("tool_calls") or []
        if calls and message["role"] != "assistant":
            return f"messages[{index}].tool_calls", "only assistant messages carry tool calls"
        if message.get("content") is None and not calls:
            return f"messages[{index}].content", "must be set (it may be null only beside tool_calls)"
        for number, call in enumerate(calls):
            try:
                arguments = json.loads(call["function"]["arguments"])
            except (ValueError, RecursionError):  # nested deeper than Python's parser goes
                arguments = None
            if not isinstance(arguments, dict):
                return (f"messages[{index}].tool_calls[{number}].function.arguments",
                        "must be a JSON object's text")
    return None


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates take them: a tool call's arguments as an object (templates write them
    with `tojson`), not as the JSON text OpenAI's history carries."""
    rendered = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            calls = [{**call, "function": {**call["function"],
                                           "arguments": json.loads(call["function"]["arguments"])}}
                     for call in calls]
            message = {**message, "tool_calls": calls}
        rendered.append(message)
    return rendered
