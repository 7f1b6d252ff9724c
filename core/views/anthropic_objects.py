"""Anthropic-shaped objects built from a plain generation result: the `message` POST /v1/messages answers (and
a Message Batches result holds), its usage and stop reason, and Anthropic's error body. Pure builders, like
core/views/openai_objects.py; the answer's tool calls are read as the chat route reads them
(core/views/tool_calls.py), each a `tool_use` block."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from conveyor.core.views.openai_objects import GenerationResult
from conveyor.core.views.tool_calls import ReadOutput, ToolCall, choice_seed, read_output

MESSAGE_ID_PREFIX = "msg_"
TOOL_USE_ID_PREFIX = "toolu_"
# Anthropic's error type per HTTP status; any other 4xx is invalid_request_error (as Anthropic documents),
# any other 5xx api_error. 503 is Conveyor's "overloaded, retry shortly" (a job that expired unstarted, the
# store unreachable): Anthropic's overloaded_error, whose own status is 529.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(error_type: str, message: str) -> dict[str, Any]:
    """Anthropic's error body: {"type": "error", "error": {"type", "message"}} (also an `error` event's)."""
    return {"type": "error", "error": {"type": error_type, "message": message}}


def message_id(job_id: str) -> str:
    """The message's id: its job's, so the job stays visible under /v1/jobs."""
    return MESSAGE_ID_PREFIX + job_id


def tool_use_id(call_id: str) -> str:
    """A tool_use block's id: the chat route's call id (derived from the job's) under Anthropic's prefix."""
    return TOOL_USE_ID_PREFIX + call_id.removeprefix("call_")


@dataclass(frozen=True)
class Ending:
    """The answer's text as Anthropic shows it, and the stop sequence that ended it (None: none did)."""

    text: str
    stop_sequence: str | None


def ending(text: str, finish_reason: str, stop_sequences: Sequence[str]) -> Ending:
    """The job keeps a matched stop sequence at the end of its text (core/protocol/anthropic_request.py asks
    for include_stop_str_in_output): it is cut off here, since Anthropic's content never holds it, and named.
    The engine ends at the earliest match, so of the sequences the text ends with, the longest matched."""
    if finish_reason != "stop":
        return Ending(text, None)
    matched = max((s for s in stop_sequences if s and text.endswith(s)), key=len, default=None)
    return Ending(text[: len(text) - len(matched)], matched) if matched is not None else Ending(text, None)


def stop_reason(finish_reason: str, stop_sequence: str | None, called_tools: bool) -> str:
    """Anthropic's stop_reason for the engine's finish_reason."""
    if finish_reason == "length":
        return "max_tokens"
    if stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if called_tools else "end_turn"


def usage(result: GenerationResult) -> dict[str, Any]:
    """Anthropic's usage: input_tokens are the prompt tokens not read from the prefix cache (Anthropic counts
    cache reads apart, so the three input counts add up to the prompt: what count_tokens says)."""
    cached = result.cached_tokens
    return {"input_tokens": result.prompt_tokens - cached, "output_tokens": result.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name,
            "input": json.loads(call.arguments)}


def content_blocks(read: ReadOutput) -> list[dict[str, Any]]:
    """A text block (always one for an answer without tool calls, even empty), then a tool_use block per
    call."""
    blocks = []
    if read.content is not None and (read.content or not read.tool_calls):
        blocks.append({"type": "text", "text": read.content})
    return blocks + [tool_use_block(call) for call in read.tool_calls]


def message_object(result: GenerationResult, message_id: str, stop_sequences: Sequence[str] = (),
                   ) -> dict[str, Any]:
    """An Anthropic `message` for a succeeded job (its first choice: a message has one). `stop_sequences`:
    the request's, which the job's text may end with (ending)."""
    ended = ending(result.text, result.finish_reason, stop_sequences)
    read = read_output(ended.text, result.chat, choice_seed(result.job_id, 0))
    return {"id": message_id, "type": "message", "role": "assistant", "model": result.model,
            "content": content_blocks(read),
            "stop_reason": stop_reason(result.finish_reason, ended.stop_sequence, bool(read.tool_calls)),
            "stop_sequence": ended.stop_sequence, "usage": usage(result)}
