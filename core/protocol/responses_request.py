"""OpenAI's Responses API request (POST /v1/responses), judged as the chat request it is.

A response is a chat job. Its body is translated into the /v1/chat/completions request
(core/protocol/openai_request.py ChatCompletionCreate) and held to exactly those rules, so none is written
twice:
- `instructions` -> a first system message; `input` -> messages (core/protocol/responses_input.py), after
  the earlier turns' conversation when `previous_response_id` names one (read from the store by the API);
- function `tools` (flat: name and parameters at the top) -> chat tools; `tool_choice` {type: function,
  name} -> a named function; `text.format` -> response_format; `max_output_tokens` ->
  max_completion_tokens; `include: ["message.output_text.logprobs"]` with `top_logprobs` -> logprobs;
- Conveyor's sampling and queue fields (seed, top_k, stop, priority, deadline_s, ...) are extras judged as
  the chat route judges them; where the job runs and how it is kept (queue, webhook, run_at, delay_s, ttl,
  timeout, max_retries) are extras the jobs API judges.
A refusal of the chat rules names the Responses field it came from. What Conveyor does not run (built-in
tools, images and files, reasoning, conversations, truncation "auto") is refused naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from conveyor.core.protocol.field_errors import validation_message
from conveyor.core.protocol.openai_request import ChatCompletionCreate, Served, check_request
from conveyor.core.protocol.refusal import Refusal
from conveyor.core.protocol.request_fields import (
    Logprobs,
    NonEmptyText,
    OpenAITemperature,
    OutputTokens,
    StoredJsonObject,
    StoredText,
    StrictFlag,
    TopP,
)
from conveyor.core.protocol.responses_input import (
    Conversation,
    InputItem,
    add_items,
    input_items,
    stored_items,
)
from conveyor.core.protocol.service_tiers import ServiceTier

RESPONSES = "/v1/responses"
OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the one `include` value Conveyor computes
# Extras the chat route judges (core/protocol/openai_request.py), sent under the same names.
CHAT_EXTRAS = ("priority", "deadline_s", "on_deadline_miss", "seed", "top_k", "min_p", "min_tokens",
               "repetition_penalty", "presence_penalty", "frequency_penalty", "stop", "stop_token_ids",
               "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "speculate",
               "chat_template_kwargs")
# Extras the jobs API judges (api/schemas/jobs.py JobPlacement): where the job runs and how it is kept.
PLACEMENT_EXTRAS = ("queue", "webhook", "run_at", "delay_s", "ttl", "timeout", "max_retries")
# OpenAI's fields that Conveyor does not run: refused by name rather than as unknown.
NOT_SUPPORTED = {"conversation": "conversations are not supported; send previous_response_id or the input",
                 "prompt": "reusable prompt templates are not supported; send the input",
                 "max_tool_calls": "max_tool_calls is not supported; parallel_tool_calls false allows one",
                 "stream_options": "stream_options is not supported",
                 "background_options": "background_options is not supported"}
# Chat fields renamed back to the Responses field a refusal names.
_RENAMED = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format",
            "logprobs": "include", "tool_choice.function": "tool_choice"}


class FunctionTool(BaseModel):
    """A tool as the Responses API sends it: `type` function, with name and parameters at the top."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(description="function; built-in tools (web_search, file_search, ...) are refused")
    name: StoredText | None = None
    description: StoredText | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictFlag | None = None

    def chat_tool(self, path: str) -> dict[str, Any]:
        if self.type != "function":
            raise Refusal("unsupported", f"{path}.type", f"built-in tools ({self.type}) are not supported; "
                          "only function tools are")
        if self.model_extra:
            raise Refusal("invalid", f"{path}.{next(iter(self.model_extra))}", "unknown field")
        function = self.model_dump(include={"name", "description", "parameters", "strict"}, exclude_none=True)
        return {"type": "function", "function": function}


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: dict[str, Any] | None = Field(None, description="{type: text}, {type: json_object} or {type: "
                                          "json_schema, name, schema, strict}")
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="accepted and ignored")

    def response_format(self) -> dict[str, Any] | None:
        """The chat route's response_format of this format (the chat rules judge it)."""
        fmt = self.format
        if fmt is None or fmt.get("type") != "json_schema":
            return fmt
        schema = {key: value for key, value in fmt.items() if key != "type"}
        return {"type": "json_schema", "json_schema": schema}


class ResponseCreate(BaseModel):
    """POST /v1/responses. Extras: Conveyor's fields (CHAT_EXTRAS, PLACEMENT_EXTRAS), judged as the chat and
    jobs routes judge them; any other field is refused."""

    model_config = ConfigDict(extra="allow")

    model: NonEmptyText | None = Field(None, description="the served model or adapter; unset: the default")
    input: StoredText | list[dict[str, Any]] = Field(
        description="a text, or message, function_call and function_call_output items")
    instructions: StoredText | None = Field(None, description="a system message before the input (not "
                                            "carried to a later turn by previous_response_id)")
    previous_response_id: NonEmptyText | None = Field(
        None, description="a completed response of the tenant's: its input and output come before this input")
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictFlag | None = None
    text: TextConfig | None = None
    max_output_tokens: OutputTokens | None = None
    temperature: OpenAITemperature | None = None
    top_p: TopP | None = None
    metadata: StoredJsonObject | None = None
    service_tier: ServiceTier | None = None
    store: StrictFlag = Field(True, description="false: nothing is kept once the answer is sent")
    background: StrictFlag = Field(False, description="answer `queued` at once; poll, stream or cancel it")
    stream: StrictFlag = False
    include: list[str] | None = Field(None, description=f"only {OUTPUT_LOGPROBS}")
    top_logprobs: Logprobs | None = None
    truncation: Literal["disabled", "auto"] | None = Field(None, description="only disabled")
    reasoning: dict[str, Any] | None = Field(None, description="only empty: no reasoning effort is run")
    user: StoredText | None = Field(None, description="accepted and ignored")
    safety_identifier: StoredText | None = Field(None, description="accepted and ignored")
    prompt_cache_key: StoredText | None = Field(None, description="accepted and ignored: prefixes are "
                                                "cached for the tenant by themselves")
    _items: list[InputItem] | None = PrivateAttr(None)

    def refusal(self) -> Refusal | None:
        """A field this server does not run, or values that contradict each other."""
        for name in self.model_extra or {}:
            if name in NOT_SUPPORTED:
                return Refusal("unsupported", name, NOT_SUPPORTED[name])
            if name not in CHAT_EXTRAS + PLACEMENT_EXTRAS:
                return Refusal("invalid", name, "unknown field")
        checks = (
            ("background", self.background and not self.store, "background needs store true"),
            ("include", any(value != OUTPUT_LOGPROBS for value in self.include or []),
             f"only {OUTPUT_LOGPROBS} is supported"),
            ("top_logprobs", self.top_logprobs is not None and OUTPUT_LOGPROBS not in (self.include or []),
             f"needs include [{OUTPUT_LOGPROBS}]"),
            ("truncation", self.truncation == "auto", "only disabled is supported: a prompt over the "
             "model's context is refused"),
            ("reasoning", any(value is not None for value in (self.reasoning or {}).values()),
             "reasoning is not supported"),
        )
        return next((Refusal("unsupported", name, reason) for name, bad, reason in checks if bad), None)

    def items(self) -> list[InputItem]:
        """The input as items, parsed once (the chat request and the stored form both read them)."""
        if self._items is None:
            self._items = input_items(self.input)
        return self._items

    def placement(self) -> dict[str, Any]:
        """Where the job runs and how it is kept, as sent (the jobs API judges them)."""
        return {name: value for name, value in (self.model_extra or {}).items() if name in PLACEMENT_EXTRAS}

    def chat_request(self, history: list[dict[str, Any]]) -> TranslatedResponse:
        """The chat request of this response, `history` (the earlier turns' messages) before its input.
        Refusal naming the Responses field."""
        refusal = self.refusal()
        if refusal is not None:
            raise refusal
        conversation = Conversation()
        if self.instructions is not None:
            conversation.add({"role": "system", "content": self.instructions}, "instructions")
        for message in history:
            conversation.add(message, "previous_response_id")
        add_items(conversation, self.items())
        body = {"messages": conversation.messages, **self._chat_fields()}
        try:
            return TranslatedResponse(ChatCompletionCreate.model_validate(body), conversation.origins)
        except ValidationError as exc:
            param, message = validation_message(exc.errors())
            raise renamed(Refusal("invalid", param, message.removeprefix(f"{param}: ") if param else message),
                          conversation.origins) from None

    def _chat_fields(self) -> dict[str, Any]:
        sent = {"model": self.model, "max_completion_tokens": self.max_output_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "service_tier": self.service_tier,
                "parallel_tool_calls": self.parallel_tool_calls, "stream": self.stream or None,
                "tools": [tool.chat_tool(f"tools[{i}]") for i, tool in enumerate(self.tools)]
                if self.tools else None,
                "tool_choice": self._chat_tool_choice(),
                "response_format": self.text.response_format() if self.text is not None else None}
        if OUTPUT_LOGPROBS in (self.include or []):
            sent.update(logprobs=True, top_logprobs=self.top_logprobs)
        extras = {name: value for name, value in (self.model_extra or {}).items() if name in CHAT_EXTRAS}
        return {**{name: value for name, value in sent.items() if value is not None}, **extras}

    def _chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if not isinstance(choice, dict):
            return choice
        if choice.get("type") != "function" or set(choice) - {"type", "name"}:
            raise Refusal("unsupported", "tool_choice", "only none, auto, required or {type: function, name} "
                          "are supported")
        return {"type": "function", "function": {"name": choice.get("name")}}

    def stored(self) -> dict[str, Any]:
        """What the job keeps of this request beyond its own fields, to show itself as a response."""
        return {
            "instructions": self.instructions,
            "input": stored_items(self.items()),
            "previous_response_id": self.previous_response_id, "background": self.background,
            "store": self.store,
            "text": self.text.model_dump(mode="json", exclude_none=True) if self.text is not None else None,
            "tools": [tool.model_dump(mode="json", exclude_none=True) for tool in self.tools or []],
            "tool_choice": self.tool_choice, "parallel_tool_calls": self.parallel_tool_calls,
            "max_output_tokens": self.max_output_tokens, "top_logprobs": self.top_logprobs,
            "include": self.include or [],
        }


@dataclass(frozen=True)
class TranslatedResponse:
    """A response's chat request, and for each of its messages the Responses field it came from."""

    chat: ChatCompletionCreate
    origins: list[str]

    def messages(self, served: Served) -> list[dict[str, Any]]:
        """The chat messages once the chat route's checks pass (the model served, fields it can honour,
        roles its template knows); Refusal naming the Responses field."""
        try:
            check_request(self.chat, served)
            return self.chat.chat_messages(served.roles)
        except Refusal as refusal:
            raise renamed(refusal, self.origins) from None


def renamed(refusal: Refusal, origins: list[str]) -> Refusal:
    """The refusal naming the Responses field that the chat field it names came from: a message by the
    item it was made of (`origins`), max_completion_tokens as max_output_tokens, a tool's function
    fields at the tool's top level."""
    param = refusal.param
    if param is None:
        return refusal
    name = _responses_name(param, origins)
    if name == param:
        return refusal
    return Refusal(refusal.kind, name, refusal.message.removeprefix(f"{param}: "))


def _responses_name(param: str, origins: list[str]) -> str:
    if param.startswith("messages["):
        index = int(param[len("messages["): param.index("]")])
        return origins[index] if index < len(origins) else "input"
    if param.startswith("tools[") and ".function" in param:
        return param.replace(".function", "", 1)
    for chat, responses in _RENAMED.items():
        if param == chat or param.startswith(chat + ".") or param.startswith(chat + "["):
            return responses + param[len(chat):]
    return param
