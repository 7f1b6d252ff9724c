"""A Responses API `input` as the chat messages every door already judges.

`input` is a text (one user message) or a list of items:
- `message` items (`type` may be left out, as OpenAI's "easy" form): a role and a text, or content parts of
  type `input_text` / `output_text` (the text of an earlier answer sent back), joined;
- `function_call` items (a call an earlier answer made) become the `tool_calls` of an assistant message, the
  one just before them when it is the assistant's;
- `function_call_output` items become `tool` messages answering their `call_id`.
Anything else (images, files, audio, reasoning items, item references, built-in tool calls) is refused
naming the item and what it is. Each message keeps the path of the item it came from (`input[2]`), so a
refusal of the chat rules names the item the client sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from conveyor.core.protocol.field_errors import validation_message
from conveyor.core.protocol.refusal import Refusal
from conveyor.core.protocol.request_fields import StoredText

TEXT_PARTS = ("input_text", "output_text")
MessageRole = Literal["user", "assistant", "system", "developer"]


class ContentPart(BaseModel):
    """One part of a message's content; only text parts run (others are refused by their type)."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: StoredText | None = None


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["message"] = "message"
    role: MessageRole
    content: StoredText | list[ContentPart]
    id: StoredText | None = Field(None, description="an earlier output item's id; kept")
    status: StoredText | None = Field(None, description="an earlier output item's status; ignored")
    phase: StoredText | None = Field(None, description="an earlier output item's phase; ignored")


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["function_call"]
    call_id: StoredText
    name: StoredText
    arguments: StoredText
    id: StoredText | None = None
    status: StoredText | None = None
    # What OpenAI's SDK dumps of an earlier answer's call besides: accepted and ignored, so that the output
    # items sent back as they came are taken.
    caller: dict[str, Any] | None = None
    namespace: StoredText | None = None
    is_async: bool | None = Field(None, alias="async")


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function_call_output"]
    call_id: StoredText
    output: StoredText | list[ContentPart]
    id: StoredText | None = None
    status: StoredText | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem
ITEM_MODELS: dict[str, type[InputItem]] = {
    "message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem}


@dataclass
class Conversation:
    """Chat messages ({role, content, tool_calls, tool_call_id}) and, for each, the field it came from."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)

    def add(self, message: dict[str, Any], origin: str) -> None:
        self.messages.append(message)
        self.origins.append(origin)


def input_items(value: str | list[dict[str, Any]]) -> list[InputItem]:
    """The input as items (a text is one user message). Refusal naming the item that cannot run."""
    if isinstance(value, str):
        return [MessageItem(role="user", content=value)]
    return [_item(raw, f"input[{index}]") for index, raw in enumerate(value)]


def _item(raw: dict[str, Any], path: str) -> InputItem:
    kind = raw.get("type", "message")
    model = ITEM_MODELS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise Refusal("unsupported", f"{path}.type", f"{kind!r} items are not supported; send message, "
                      "function_call or function_call_output items")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        param, message = validation_message(exc.errors())
        reason = message.removeprefix(f"{param}: ") if param else message
        raise Refusal("invalid", f"{path}.{param}" if param else path, reason) from None


def add_items(conversation: Conversation, items: list[InputItem], prefix: str = "input") -> None:
    """Appends the items as chat messages; a call joins the assistant message just before it."""
    for index, item in enumerate(items):
        path = f"{prefix}[{index}]"
        if isinstance(item, MessageItem):
            conversation.add({"role": item.role, "content": _text(item.content, f"{path}.content")}, path)
        elif isinstance(item, FunctionCallItem):
            _add_call(conversation, item, path)
        else:
            output = _text(item.output, f"{path}.output")
            conversation.add({"role": "tool", "tool_call_id": item.call_id, "content": output}, path)


def _add_call(conversation: Conversation, item: FunctionCallItem, path: str) -> None:
    function = {"name": item.name, "arguments": item.arguments}
    call = {"id": item.call_id, "type": "function", "function": function}
    last = conversation.messages[-1] if conversation.messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
        return
    conversation.add({"role": "assistant", "content": None, "tool_calls": [call]}, path)


def _text(content: str | list[ContentPart], path: str) -> str:
    if isinstance(content, str):
        return content
    for index, part in enumerate(content):
        if part.type not in TEXT_PARTS or part.text is None:
            raise Refusal("unsupported", f"{path}[{index}].type", f"{part.type!r} content is not supported; "
                          "only text (input_text, output_text) is")
    return "".join(part.text or "" for part in content)


def stored_items(items: list[InputItem]) -> list[dict[str, Any]]:
    """The items as GET /v1/responses/{id}/input_items lists them (ids are added from the job's when they
    were sent without one): a message's text as one text part."""
    stored = []
    for item in items:
        shown = item.model_dump(mode="json", exclude_none=True)
        if isinstance(item, MessageItem) and isinstance(item.content, str):
            part = "output_text" if item.role == "assistant" else "input_text"
            shown["content"] = [{"type": part, "text": item.content}]
        stored.append(shown)
    return stored
