"""Reading tool calls out of a chat job's text: the answer's `content` and `tool_calls`, whole or streamed.

The text is read by what the job asked for (core/protocol/chat_options.py):
- tool_choice `none` or no tools: all of it is content;
- a named function: the text is that function's arguments (constrained by their schema);
- `required`: a JSON array of {"name", "arguments"} (constrained);
- `auto`: the model's own format, read by the tool parser:
  - hermes (Hermes, Qwen): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, content before it;
  - llama3_json: the whole answer is `{"name": ..., "parameters": {...}}`, several joined by `;`, optionally
    after `<|python_tag|>`;
  - mistral: content, then `[TOOL_CALLS]` and a JSON array of calls (or, in newer templates,
    `[TOOL_CALLS]name[ARGS]{...}` per call).
A call that does not parse leaves the whole text as content: nothing the model wrote is lost.

Call ids are derived from the job's id, so every read of a job (its GET, its webhook, a batch's output line)
names its calls alike.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from conveyor.core.protocol.chat_options import ChatOptions

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
PYTHON_TAG = "<|python_tag|>"
_HERMES_CALL = re.compile(rf"{re.escape(HERMES_OPEN)}(.*?)(?:{re.escape(HERMES_CLOSE)}|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ReadOutput:
    content: str | None
    tool_calls: list[ToolCall]


def choice_seed(job_id: str, index: int) -> str:
    """What names the calls of a job's choice `index` (choice 0: the job id itself)."""
    return job_id if index == 0 else f"{job_id}/{index}"


def call_id(seed: str, index: int) -> str:
    return "call_" + hashlib.sha256(f"{seed}:{index}".encode()).hexdigest()[:24]


def read_output(text: str, options: ChatOptions, seed: str) -> ReadOutput:
    """The answer's content and tool calls; `seed` (the job id) names the calls."""
    if not options.reads_tool_calls:
        return ReadOutput(text, [])
    calls = _read_calls(text, options)
    if calls is None:
        return ReadOutput(text, [])
    named = [ToolCall(call_id(seed, index), name, arguments) for index, (name, arguments) in enumerate(calls)]
    return ReadOutput(_content_before_calls(text, options), named)


def _read_calls(text: str, options: ChatOptions) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) per call, or None when the text holds no well-formed call."""
    choice = options.tool_choice
    if isinstance(choice, dict):
        arguments = _json(text)
        return [(choice["function"]["name"], text.strip())] if isinstance(arguments, dict) else None
    if choice == "required":
        return _calls(_json(text), "arguments")
    reader = {"hermes": _hermes, "llama3_json": _llama3, "mistral": _mistral}[options.tool_parser]
    calls = reader(text)
    known = {tool["function"]["name"] for tool in options.tools or []}
    return calls if calls and all(name in known for name, _ in calls) else None


def _content_before_calls(text: str, options: ChatOptions) -> str | None:
    if options.constrained or options.tool_parser == "llama3_json":
        return None
    mark = HERMES_OPEN if options.tool_parser == "hermes" else MISTRAL_MARK
    return text[: text.find(mark)].strip() or None


def _json(text: str) -> Any:
    """The JSON value of a model's text, or None (a model may write anything, nested arbitrarily deep)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _calls(items: Any, *argument_keys: str) -> list[tuple[str, str]] | None:
    """[{"name", <an argument key>: object or JSON text}, ...] -> [(name, arguments JSON)], else None."""
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        key = next((k for k in argument_keys if k in item), None)
        arguments = item.get(key) if key is not None else {}
        if isinstance(arguments, str):
            arguments = _json(arguments)
        if not isinstance(arguments, dict):
            return None
        calls.append((item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls


def _hermes(text: str) -> list[tuple[str, str]] | None:
    bodies = [_json(body) for body in _HERMES_CALL.findall(text)]
    return _calls(bodies, "arguments", "parameters")


def _llama3(text: str) -> list[tuple[str, str]] | None:
    rest = text.strip().removeprefix(PYTHON_TAG).strip()
    decoder, items, at = json.JSONDecoder(), [], 0
    while at < len(rest):
        try:
            item, at = decoder.raw_decode(rest, at)
        except (ValueError, RecursionError):
            return None
        items.append(item)
        at = len(rest) - len(rest[at:].lstrip().removeprefix(";").lstrip())
    return _calls(items, "parameters", "arguments")


def _mistral(text: str) -> list[tuple[str, str]] | None:
    at = text.find(MISTRAL_MARK)
    if at < 0:
        return None
    rest = text[at + len(MISTRAL_MARK):].strip()
    if rest.startswith("["):
        return _calls(_json(rest), "arguments")
    items = []
    for part in rest.split(MISTRAL_MARK):
        name, args_mark, arguments = part.partition(MISTRAL_ARGS)
        if not args_mark:
            return None
        items.append({"name": name.strip(), "arguments": arguments.strip()})
    return _calls(items, "arguments")
