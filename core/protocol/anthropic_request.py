"""Anthropic's Messages API request (POST /v1/messages, /v1/messages/count_tokens, a Message Batches request's
`params`), turned into the OpenAI chat request every other door sends (core/protocol/openai_request.py), so
that one set of rules judges it and one job shape runs it; nothing here judges a field twice.

Three steps, each refusing with a `Refusal` that names the field as the Anthropic request wrote it:
1. the pydantic models below: Anthropic's shapes, unknown fields refused; blocks and tools Conveyor does not
   run (images, documents, thinking, server tools such as web_search) refused by their type;
2. `chat_request`: the translation into a `ChatCompletionCreate`:
   - `system` -> a system message first;
   - a user message's text blocks -> a user message, each `tool_result` -> a tool message answering its
     `tool_use_id`; an assistant message's text -> its content, its `tool_use` blocks -> its tool calls;
   - `tools` (name, description, input_schema) -> function tools; `tool_choice` auto/any/tool/none ->
     auto/required/the named function/none, `disable_parallel_tool_use` -> parallel_tool_calls false;
   - a last assistant message is a prefill: the answer continues it (continue_final_message);
   - `stop_sequences` -> stop, kept at the end of the job's text (include_stop_str_in_output) so the answer
     can say which one matched (core/views/anthropic_objects.py cuts it off again);
   - `metadata.user_id` -> user (accepted, ignored), `service_tier` auto/standard_only -> auto/default;
3. `judged`: the chat request held to the OpenAI rules (check_request, the chat roles of the model's
   template), every refusal renamed to the Anthropic field it came from (`anthropic_field`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
)
from pydantic_core import PydanticCustomError

from conveyor.core.protocol.field_errors import validation_message
from conveyor.core.protocol.openai_request import ChatCompletionCreate, Served, check_request
from conveyor.core.protocol.refusal import Refusal
from conveyor.core.protocol.request_fields import (
    AnthropicTemperature,
    DeadlineSeconds,
    NonEmptyText,
    OnDeadlineMiss,
    Priority,
    Seed,
    StopStrings,
    StoredJsonObject,
    StoredText,
    StrictFlag,
    TokenCount,
    TopK,
    TopP,
)
from conveyor.core.protocol.tools import FUNCTION_NAME_PATTERN

MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
TEXT_BLOCKS = ("text",)
MESSAGE_BLOCKS = ("text", "tool_use", "tool_result")
# Anthropic's service tiers as OpenAI's: `auto` and `standard_only` both run at the default tier here.
SERVICE_TIERS = {"auto": "auto", "standard_only": "default"}
# Request fields Anthropic defines that Conveyor does not run: sent (not null), each is refused by name.
UNSUPPORTED_FIELDS = {
    "mcp_servers": "MCP servers are not supported",
    "container": "containers (code execution) are not supported",
    "context_management": "context management is not supported",
    "output_config": "output_config is not supported",
    "output_format": "output_format is not supported",
}
FunctionName = Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]


def _supported(allowed: tuple[str, ...]) -> BeforeValidator:
    """Refuses a content block of a type Anthropic defines but Conveyor does not run, saying so (rather than
    pydantic's "does not match any of the expected tags")."""
    def check(value: object) -> object:
        kind = value.get("type") if isinstance(value, dict) else None
        if isinstance(kind, str) and kind not in allowed:
            raise PydanticCustomError(
                "unsupported_block", "{kind} blocks are not supported here; send {allowed} blocks",
                {"kind": kind, "allowed": ", ".join(allowed)})
        return value
    return BeforeValidator(check)


def _by_type(*models: type[BaseModel]) -> Discriminator:
    """A union of models told apart by their `type`, each tagged with its class name: a refusal then names
    the field as sent (field_errors drops a capitalised union tag), not `content[0].tool_result.content`."""
    tags = {get_args(model.model_fields["type"].annotation)[0]: model.__name__ for model in models}

    def tag(value: object) -> str | None:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return tags.get(kind) if isinstance(kind, str) else None
    return Discriminator(tag, custom_error_type="unknown_kind",
                         custom_error_message=f"type must be one of {', '.join(tags)}")


def _custom_tool(value: object) -> object:
    """A server tool (web_search, bash, code_execution, ...) runs on Anthropic's side: Conveyor has none."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in (None, "custom"):
        raise PydanticCustomError(
            "unsupported_tool", "{kind} is a server tool, which is not supported; only custom tools (name, "
            "description, input_schema) run", {"kind": str(kind)})
    return value


class CacheControl(BaseModel):
    """Accepted and ignored: Conveyor's prefix cache finds repeated prompt prefixes on its own."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: StoredText
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = Field(None, description="only null or empty: not supported")

    @field_validator("citations")
    @classmethod
    def _no_citations(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if value:
            raise PydanticCustomError("unsupported", "citations are not supported")
        return value


class ToolUseBlock(BaseModel):
    """A call an earlier assistant turn made."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["tool_use"]
    id: StoredText
    name: FunctionName
    input: StoredJsonObject
    cache_control: CacheControl | None = None
    # What the SDK's own ToolUseBlock holds besides, so an answer's content sent back as it came is taken.
    caller: dict[str, Any] | None = Field(None, description="accepted and ignored: who made the call")
    toolset_name: StoredText | None = Field(None, description="accepted and ignored")


TextBlocks = list[Annotated[TextBlock, _supported(TEXT_BLOCKS)]]


class ToolResultBlock(BaseModel):
    """A tool's answer to a call, sent in a user turn."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["tool_result"]
    tool_use_id: StoredText
    content: StoredText | TextBlocks | None = None
    is_error: StrictFlag | None = Field(None, description="accepted; the model is shown the content alone")
    cache_control: CacheControl | None = None


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("TextBlock")] | Annotated[ToolUseBlock, Tag("ToolUseBlock")]
    | Annotated[ToolResultBlock, Tag("ToolResultBlock")],
    _by_type(TextBlock, ToolUseBlock, ToolResultBlock), _supported(MESSAGE_BLOCKS)]


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: StoredText | list[ContentBlock]


class CustomTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: FunctionName
    description: StoredText | None = None
    input_schema: dict[str, Any] = Field(description="a JSON Schema of the input object")
    type: Literal["custom"] | None = None
    strict: StrictFlag | None = None
    cache_control: CacheControl | None = None

    def as_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description, "parameters": self.input_schema,
                    "strict": self.strict}
        return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


class ToolChoiceAuto(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["auto"]
    disable_parallel_tool_use: StrictFlag | None = None


class ToolChoiceAny(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["any"]
    disable_parallel_tool_use: StrictFlag | None = None


class ToolChoiceTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["tool"]
    name: FunctionName
    disable_parallel_tool_use: StrictFlag | None = None


class ToolChoiceNone(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["none"]


ToolChoice = Annotated[
    Annotated[ToolChoiceAuto, Tag("ToolChoiceAuto")] | Annotated[ToolChoiceAny, Tag("ToolChoiceAny")]
    | Annotated[ToolChoiceTool, Tag("ToolChoiceTool")] | Annotated[ToolChoiceNone, Tag("ToolChoiceNone")],
    _by_type(ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool, ToolChoiceNone)]


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user_id: StoredText | None = Field(None, description="accepted and ignored")


@dataclass(frozen=True)
class Origin:
    """Where a chat message of the translation came from in the Anthropic request: its path, its content's,
    each of its text parts' and each of its tool calls' (a refusal naming one is renamed to it)."""

    path: str
    content: str
    parts: tuple[str, ...] = ()
    calls: tuple[str, ...] = ()


@dataclass(frozen=True)
class Turn:
    """One chat message of the translation (ChatMessageIn's shape) and where it came from."""

    message: dict[str, Any]
    origin: Origin


@dataclass(frozen=True)
class JudgedChat:
    """A request the rules accepted: the chat request, and its messages as the chat template takes them."""

    request: ChatCompletionCreate
    messages: list[dict[str, Any]]


class MessageInput(BaseModel):
    """What POST /v1/messages and /v1/messages/count_tokens share: the conversation and its tools."""

    model_config = ConfigDict(extra="forbid")

    model: NonEmptyText = Field(description="the served model (GET /v1/models)")
    messages: list[MessageParam] = Field(min_length=1)
    system: StoredText | TextBlocks | None = None
    tools: list[Annotated[CustomTool, BeforeValidator(_custom_tool)]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = Field(None, description='only {"type": "disabled"}: extended thinking '
                                            "is not supported")
    cache_control: CacheControl | None = Field(None, description="accepted and ignored")
    mcp_servers: Any | None = Field(None, description="refused: not supported")
    container: Any | None = Field(None, description="refused: not supported")
    context_management: Any | None = Field(None, description="refused: not supported")
    output_config: Any | None = Field(None, description="refused: not supported")
    output_format: Any | None = Field(None, description="refused: not supported")

    def chat_request(self) -> ChatCompletionCreate:
        """The OpenAI chat request this one is. Refusal naming the Anthropic field."""
        self._refuse_unsupported()
        turns = self._turns()
        body = {"model": self.model, "messages": [turn.message for turn in turns], **self._chat_fields(turns)}
        try:
            return ChatCompletionCreate.model_validate(body)
        except ValidationError as exc:
            param, message = validation_message(exc.errors())
            raise self.anthropic_refusal(Refusal("invalid", param, _reason(message, param))) from None

    def judged(self, served: Served) -> JudgedChat:
        """The chat request held to the rules every door shares (the model served, fields it cannot honour,
        the chat roles its template knows). Refusal naming the Anthropic field."""
        request = self.chat_request()
        try:
            check_request(request, served)
            return JudgedChat(request, request.chat_messages(served.roles))
        except Refusal as refusal:
            raise self.anthropic_refusal(refusal) from None

    def anthropic_refusal(self, refusal: Refusal) -> Refusal:
        """A refusal of the chat request, naming the Anthropic field it came from."""
        field = self.anthropic_field(refusal.param)
        return Refusal(refusal.kind, field, _reason(refusal.message, refusal.param))

    def anthropic_field(self, field: str | None) -> str | None:
        """The Anthropic field a field of the chat request came from (`messages[3].tool_calls[0]` ->
        `messages[1].content[2]`, `stop` -> `stop_sequences`); a field of neither kind as it is."""
        if field is None:
            return None
        matched = _MESSAGE_FIELD.match(field)
        if matched is not None:
            turns = self._turns()
            index = int(matched.group(1))
            return _message_field(turns[index].origin, matched.group(2)) if index < len(turns) else field
        for pattern, replacement in _RENAMED:
            renamed, count = pattern.subn(replacement, field)
            if count:
                return renamed
        return field

    def _refuse_unsupported(self) -> None:
        if self.thinking is not None and self.thinking.get("type") != "disabled":
            raise Refusal("unsupported", "thinking", "extended thinking is not supported")
        for name, reason in UNSUPPORTED_FIELDS.items():
            if getattr(self, name) is not None:
                raise Refusal("unsupported", name, reason)

    def _turns(self) -> list[Turn]:
        turns = [] if self.system is None else [_text_turn("system", self.system, "system", "system")]
        for index, message in enumerate(self.messages):
            turns += _message_turns(message, f"messages[{index}]")
        return turns

    def _chat_fields(self, turns: list[Turn]) -> dict[str, Any]:
        """The chat request's fields besides model and messages: the tools, and those of MessageCreate."""
        fields: dict[str, Any] = {}
        if self.tools is not None:
            fields["tools"] = [tool.as_openai() for tool in self.tools]
        choice = self.tool_choice
        if choice is not None:
            fields["tool_choice"] = _openai_choice(choice)
            if not isinstance(choice, ToolChoiceNone) and choice.disable_parallel_tool_use:
                fields["parallel_tool_calls"] = False
        if turns[-1].message["role"] == "assistant" and not turns[-1].message.get("tool_calls"):
            fields["continue_final_message"] = True  # a prefill: the answer continues it
        return fields


class MessageCreate(MessageInput):
    """POST /v1/messages: Anthropic's fields, and Conveyor's queue fields (its SDK's `extra_body`)."""

    max_tokens: TokenCount = Field(description="required: the most tokens the answer may have")
    stop_sequences: StopStrings | None = Field(None, description="the answer ends before any of these; "
                                               "stop_sequence says which one")
    stream: StrictFlag | None = False
    temperature: AnthropicTemperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = Field(
        None, description="both run at the default tier (OpenAI's auto and default)")
    # Conveyor's own (the SDK's extra_body), as the OpenAI routes take them.
    seed: Seed | None = None
    priority: Priority | None = Field(None, description="Conveyor's: lower is served first (default 0)")
    deadline_s: DeadlineSeconds | None = None
    on_deadline_miss: OnDeadlineMiss | None = None

    def _chat_fields(self, turns: list[Turn]) -> dict[str, Any]:
        sampling = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                    "top_k": self.top_k, "seed": self.seed, "stream": self.stream, "priority": self.priority,
                    "deadline_s": self.deadline_s, "on_deadline_miss": self.on_deadline_miss,
                    "user": self.metadata.user_id if self.metadata is not None else None,
                    "service_tier": SERVICE_TIERS.get(self.service_tier or "")}
        if self.stop_sequences:
            sampling |= {"stop": self.stop_sequences, "include_stop_str_in_output": True}
        sent = {name: value for name, value in sampling.items() if value is not None}
        return {**super()._chat_fields(turns), **sent}


class MessageCountTokens(MessageInput):
    """POST /v1/messages/count_tokens: the conversation alone."""


def parse_message_body(body: dict[str, Any]) -> MessageCreate:
    """A Message Batches request's `params` validated as POST /v1/messages validates its body; Refusal
    naming the field otherwise."""
    try:
        return MessageCreate.model_validate(body)
    except ValidationError as exc:
        param, message = validation_message(exc.errors())
        raise Refusal("invalid", param, _reason(message, param)) from None


def _reason(message: str, param: str | None) -> str:
    return message.removeprefix(f"{param}: ") if param else message


def _openai_choice(choice: ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone,
                   ) -> str | dict[str, Any]:
    if isinstance(choice, ToolChoiceTool):
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _text_turn(role: str, content: str | list[TextBlock], path: str, content_path: str) -> Turn:
    """A message whose content is text, or text blocks (joined as OpenAI's text parts are)."""
    if isinstance(content, str):
        return Turn({"role": role, "content": content}, Origin(path, content_path))
    parts = [{"type": "text", "text": block.text} for block in content]
    paths = tuple(f"{content_path}[{index}]" for index in range(len(content)))
    return Turn({"role": role, "content": parts}, Origin(path, content_path, paths))


def _message_turns(message: MessageParam, path: str) -> list[Turn]:
    content = f"{path}.content"
    if isinstance(message.content, str):
        return [_text_turn(message.role, message.content, path, content)]
    blocks = list(enumerate(message.content))
    wrong = "tool_result" if message.role == "assistant" else "tool_use"
    misplaced = next((number for number, block in blocks if block.type == wrong), None)
    if misplaced is not None:
        where = "user" if wrong == "tool_result" else "assistant"
        raise Refusal("invalid", f"{content}[{misplaced}]", f"{wrong} blocks belong in {where} messages")
    if message.role == "assistant":
        return [_assistant_turn(blocks, path)]
    return _user_turns(blocks, path)


def _assistant_turn(blocks: list[tuple[int, ContentBlock]], path: str) -> Turn:
    """Its text blocks as the content, its tool_use blocks as the tool calls."""
    texts = [(number, block) for number, block in blocks if isinstance(block, TextBlock)]
    uses = [(number, block) for number, block in blocks if isinstance(block, ToolUseBlock)]
    message: dict[str, Any] = {"role": "assistant",
                               "content": [{"type": "text", "text": block.text} for _, block in texts]}
    if uses:
        message["tool_calls"] = [_tool_call(block) for _, block in uses]
        if not texts:
            message["content"] = None
    content = f"{path}.content"
    origin = Origin(path, content, tuple(f"{content}[{number}]" for number, _ in texts),
                    tuple(f"{content}[{number}]" for number, _ in uses))
    return Turn(message, origin)


def _tool_call(block: ToolUseBlock) -> dict[str, Any]:
    arguments = json.dumps(block.input, ensure_ascii=False)
    return {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}


def _user_turns(blocks: list[tuple[int, ContentBlock]], path: str) -> list[Turn]:
    """Runs of text blocks as user messages, each tool_result as a tool message, in their order."""
    turns: list[Turn] = []
    texts: list[tuple[int, TextBlock]] = []
    for number, block in blocks:
        if isinstance(block, TextBlock):
            texts.append((number, block))
            continue
        if texts:
            turns.append(_user_text_turn(texts, path))
            texts = []
        assert isinstance(block, ToolResultBlock), "a user message's tool_use was refused"
        turns.append(_tool_turn(block, f"{path}.content[{number}]"))
    if texts or not turns:  # an empty content list is an empty user message
        turns.append(_user_text_turn(texts, path))
    return turns


def _user_text_turn(texts: list[tuple[int, TextBlock]], path: str) -> Turn:
    content = f"{path}.content"
    parts = [{"type": "text", "text": block.text} for _, block in texts]
    return Turn({"role": "user", "content": parts},
                Origin(path, content, tuple(f"{content}[{number}]" for number, _ in texts)))


def _tool_turn(block: ToolResultBlock, path: str) -> Turn:
    content = block.content if block.content is not None else ""
    turn = _text_turn("tool", content, path, f"{path}.content")
    return Turn({**turn.message, "tool_call_id": block.tool_use_id}, turn.origin)


_MESSAGE_FIELD = re.compile(r"^messages\[(\d+)\](.*)$")
_CALL_FIELD = re.compile(r"^\.tool_calls\[(\d+)\](.*)$")
_PART_FIELD = re.compile(r"^\.content\[(\d+)\](.*)$")
_CALL_FIELDS = {".function.arguments": ".input", ".function.name": ".name", ".function": "", ".id": ".id"}
_RENAMED = [(re.compile(pattern), replacement) for pattern, replacement in (
    (r"^tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
    (r"^tools\[(\d+)\]\.function", r"tools[\1]"),
    (r"^tool_choice\.function", "tool_choice"),
    (r"^parallel_tool_calls$", "tool_choice.disable_parallel_tool_use"),
    (r"^stop(?=$|\[)", "stop_sequences"),
    (r"^max_completion_tokens$", "max_tokens"),
    (r"^user$", "metadata.user_id"),
    (r"^prompt$", "messages"),
    (r"^(continue_final_message|add_generation_prompt)$", "messages"),
)]


def _message_field(origin: Origin, rest: str) -> str:
    """A field within a translated message, named where its origin has it."""
    call = _CALL_FIELD.match(rest)
    if call is not None and int(call.group(1)) < len(origin.calls):
        return origin.calls[int(call.group(1))] + _CALL_FIELDS.get(call.group(2), "")
    part = _PART_FIELD.match(rest)
    if part is not None and int(part.group(1)) < len(origin.parts):
        return origin.parts[int(part.group(1))] + part.group(2)
    if rest.startswith(".content"):
        return origin.content
    return origin.path
