"""OpenAI-shaped objects built from a plain generation result: `chat.completion` and `text_completion`
bodies, and batch output and error lines. Shared by the batch writer and the HTTP chat/completions routes."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class GenerationResult:
    text: str
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    model: str
    created: int  # unix seconds


def new_id(prefix: str) -> str:
    """`prefix` + 32 hex digits, e.g. new_id("batch_req_")."""
    return prefix + uuid.uuid4().hex


def usage(result: GenerationResult) -> dict[str, int]:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens}


def chat_completion(result: GenerationResult, completion_id: str) -> dict[str, Any]:
    """A `chat.completion` object with one choice."""
    choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
              "logprobs": None, "finish_reason": _finish_reason(result)}
    return {"id": completion_id, "object": "chat.completion", "created": result.created,
            "model": result.model, "choices": [choice], "usage": usage(result)}


def text_completion(result: GenerationResult, completion_id: str) -> dict[str, Any]:
    """A `text_completion` object with one choice."""
    choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": _finish_reason(result)}
    return {"id": completion_id, "object": "text_completion", "created": result.created,
            "model": result.model, "choices": [choice], "usage": usage(result)}


def batch_result_line(custom_id: str, body: dict[str, Any], *, line_id: str, request_id: str,
                      ) -> dict[str, Any]:
    """One line of the batch output file for a request that ran."""
    return {"id": line_id, "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}


def batch_error_line(custom_id: str | None, *, line: int, code: str, message: str, line_id: str,
                     ) -> dict[str, Any]:
    """One line of the batch error file (also written to the output file, so it has a line per input)."""
    return {"id": line_id, "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}, "line": line}


def _finish_reason(result: GenerationResult) -> str:
    if result.finish_reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {result.finish_reason!r}")
    return result.finish_reason
