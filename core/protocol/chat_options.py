"""How a chat job's messages are rendered and its answer read: stored as the job's `chat` column.

Rendering: the tools offered, add_generation_prompt, continue_final_message and chat_template_kwargs, all
passed to the model's chat template (the worker renders it; the API renders it too, to count the prompt).
Reading: tool_choice, parallel_tool_calls and the tool parser the text is read with
(core/views/tool_calls.py). A job without any of them stores NULL and renders exactly as before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Literal

from conveyor.core.protocol.job_params import JobParams
from conveyor.core.protocol.tools import Tool, ToolChoice, choice_json, constrained_schema, tools_problem

ToolParser = Literal["hermes", "llama3_json", "mistral"]
TOOL_PARSERS: tuple[ToolParser, ...] = ("hermes", "llama3_json", "mistral")
# apply_chat_template's own parameters: chat_template_kwargs may not set them behind the request's back.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def tool_parser_for(setting: str, template: object) -> ToolParser:
    """The parser a setting names, or for `auto` the one the chat template's own markers point to
    (Hermes/Qwen `<tool_call>` when none does)."""
    if setting in TOOL_PARSERS:
        return setting  # type: ignore[return-value]
    source = template if isinstance(template, str) else ""
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "<|python_tag|>" in source or "ipython" in source:
        return "llama3_json"
    return "hermes"


@dataclass(frozen=True)
class ChatOptions:
    tools: list[dict[str, Any]] | None = None  # OpenAI's tool objects, as sent
    tool_choice: str | dict[str, Any] = "none"  # none, auto, required or {"type": "function", ...}
    parallel_tool_calls: bool = True
    tool_parser: ToolParser = "hermes"
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @classmethod
    def from_json(cls, stored: dict[str, Any] | None) -> ChatOptions:
        """The stored form read back; keys this version does not know (a newer writer's) are left out."""
        known = {f.name for f in fields(cls)}
        return cls(**{name: value for name, value in (stored or {}).items() if name in known})

    def to_json(self) -> dict[str, Any] | None:
        """Only what differs from the defaults; None when nothing does."""
        defaults = ChatOptions()
        stored = {f.name: getattr(self, f.name) for f in fields(self)
                  if getattr(self, f.name) != getattr(defaults, f.name)}
        if not self.reads_tool_calls:
            stored.pop("tool_parser", None)
        return stored or None

    @property
    def reads_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def constrained(self) -> bool:
        """The output is the call itself (tool_choice required or named), held to a JSON schema."""
        return self.reads_tool_calls and self.tool_choice != "auto"

    def structured(self) -> dict[str, Any] | None:
        """The constraint in the engine's structured form, or None."""
        if not self.constrained:
            return None
        assert self.tools is not None
        schema = constrained_schema(self.tools, self.tool_choice, self.parallel_tool_calls)
        return {"json_schema": schema} if schema is not None else None

    def keeps_special_tokens(self) -> bool:
        """Mistral's [TOOL_CALLS] and Llama 3's <|python_tag|> are special tokens: the parser needs them in
        the text."""
        return self.tool_choice == "auto" and bool(self.tools) and self.tool_parser != "hermes"

    def template_kwargs(self) -> dict[str, Any]:
        """apply_chat_template's keyword arguments beyond the messages."""
        kwargs: dict[str, Any] = {"add_generation_prompt": self.add_generation_prompt,
                                  "continue_final_message": self.continue_final_message}
        if self.tools:
            kwargs["tools"] = self.tools
        return {**(self.chat_template_kwargs or {}), **kwargs}

    def template_bytes(self) -> int:
        """The size of what the template adds to the messages (tools, its variables), as JSON."""
        added = [self.tools, self.chat_template_kwargs]
        return len(json.dumps(added, ensure_ascii=False).encode()) if any(added) else 0


def job_params(params: dict[str, Any], options: ChatOptions) -> dict[str, Any]:
    """A chat job's stored params (core/protocol/job_params.py) with what its options need: the tool call's
    constraint (a structured output), and special tokens kept when the parser reads them."""
    structured = options.structured()
    if structured is not None:
        assert "structured" not in params, "a constrained tool call is refused beside a structured output"
        params = {**params, "structured": structured}
    if options.keeps_special_tokens():
        params = {**params, "skip_special_tokens": False}
    return JobParams.written(params)


def chat_options(
    *, tools: list[Tool] | None, tool_choice: ToolChoice | None, parallel_tool_calls: bool | None,
    add_generation_prompt: bool | None, continue_final_message: bool | None,
    chat_template_kwargs: dict[str, Any] | None, parser: ToolParser,
) -> ChatOptions:
    """The options a request's fields make. ValueError "<field>: <reason>" for what cannot run."""
    problem = tools_problem(tools, tool_choice) or _template_problem(
        add_generation_prompt, continue_final_message, chat_template_kwargs)
    if problem is not None:
        raise ValueError(f"{problem[0]}: {problem[1]}")
    tool_json = [tool.model_dump(mode="json", exclude_none=True) for tool in tools] if tools else None
    if add_generation_prompt is None:
        add_generation_prompt = not continue_final_message
    return ChatOptions(
        tools=tool_json, tool_choice=choice_json(tool_choice, tools),
        parallel_tool_calls=True if parallel_tool_calls is None else parallel_tool_calls, tool_parser=parser,
        add_generation_prompt=add_generation_prompt, continue_final_message=bool(continue_final_message),
        chat_template_kwargs=chat_template_kwargs or None)


def _template_problem(add_generation_prompt: bool | None, continue_final_message: bool | None,
                      chat_template_kwargs: dict[str, Any] | None) -> tuple[str, str] | None:
    if add_generation_prompt and continue_final_message:
        return "continue_final_message", "cannot be set with add_generation_prompt"
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(chat_template_kwargs or {}))
    if reserved:
        return "chat_template_kwargs", f"{reserved[0]} is set by the request itself"
    return None
