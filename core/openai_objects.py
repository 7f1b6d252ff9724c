"""OpenAI-shaped objects built from a plain generation result: `chat.completion` and `text_completion` bodies
and their streamed chunks. Pure builders shared by the HTTP chat/completions routes and the batch writer
(core/openai_objects.py re-exports the body builders)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from itertools import accumulate
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
    # As a job stores them, per generated token {token_id, text, logprob, top_logprobs}; None = not asked
    logprobs: list[dict[str, Any]] | None = None
    cached_tokens: int = 0  # prompt tokens served from the engine's prefix cache


def new_id(prefix: str) -> str:
    """`prefix` + 32 hex digits, e.g. new_id("batch_req_")."""
    return prefix + uuid.uuid4().hex


def usage(result: GenerationResult) -> dict[str, Any]:
    """OpenAI's usage object; prompt tokens found in the prefix cache under prompt_tokens_details."""
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}


def chat_completion(result: GenerationResult, completion_id: str) -> dict[str, Any]:
    """A `chat.completion` object with one choice."""
    logprobs = _chat_logprobs(result.logprobs) if result.logprobs is not None else None
    choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
              "logprobs": logprobs, "finish_reason": _finish_reason(result)}
    return {"id": completion_id, "object": "chat.completion", "created": result.created,
            "model": result.model, "choices": [choice], "usage": usage(result)}


def text_completion(result: GenerationResult, completion_id: str) -> dict[str, Any]:
    """A `text_completion` object with one choice."""
    logprobs = _completion_logprobs(result.logprobs) if result.logprobs is not None else None
    choice = {"index": 0, "text": result.text, "logprobs": logprobs, "finish_reason": _finish_reason(result)}
    return {"id": completion_id, "object": "text_completion", "created": result.created,
            "model": result.model, "choices": [choice], "usage": usage(result)}


def _chat_logprobs(tokens: list[dict[str, Any]]) -> dict[str, Any]:
    """Chat's shape: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    def one(entry: dict[str, Any]) -> dict[str, Any]:
        return {"token": entry["text"], "logprob": entry["logprob"], "bytes": list(entry["text"].encode())}

    content = [{**one(t), "top_logprobs": [one(alt) for alt in t["top_logprobs"]]} for t in tokens]
    return {"content": content, "refusal": None}


def _completion_logprobs(tokens: list[dict[str, Any]]) -> dict[str, Any]:
    """Completions' shape: parallel lists of token texts, their logprobs, {text: logprob} alternatives and
    each token's character offset in the generated text."""
    texts = [t["text"] for t in tokens]
    offsets = [0, *accumulate(len(text) for text in texts)][: len(texts)]
    return {"tokens": texts, "token_logprobs": [t["logprob"] for t in tokens],
            "top_logprobs": [{alt["text"]: alt["logprob"] for alt in t["top_logprobs"]} for t in tokens],
            "text_offset": offsets}


@dataclass(frozen=True)
class ChunkHeader:
    """What every chunk of one streamed completion repeats."""

    completion_id: str
    model: str
    created: int
    chat: bool  # chat.completion.chunk, else text_completion


def chunk(header: ChunkHeader, text: str | None, finish_reason: str | None = None,
          *, role: bool = False, usage_so_far: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chunk with one choice: a text delta, a role opener or the closing finish_reason; with
    `usage_so_far` (vLLM's `stream_options.continuous_usage_stats`) the usage up to this chunk too."""
    if header.chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta}
    else:
        choice = {"index": 0, "text": text or ""}
    choice.update(logprobs=None, finish_reason=finish_reason)
    body = _chunk_body(header, [choice])
    if usage_so_far is not None:
        body["usage"] = usage_so_far
    return body


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The usage of a completion still being generated: its prompt and the tokens generated so far."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def usage_chunk(header: ChunkHeader, result: GenerationResult) -> dict[str, Any]:
    """The extra last chunk sent with `stream_options.include_usage`: no choices, the usage."""
    return {**_chunk_body(header, []), "usage": usage(result)}


def _chunk_body(header: ChunkHeader, choices: list[dict[str, Any]]) -> dict[str, Any]:
    kind = "chat.completion.chunk" if header.chat else "text_completion"
    return {"id": header.completion_id, "object": kind, "created": header.created, "model": header.model,
            "choices": choices}


def _finish_reason(result: GenerationResult) -> str:
    if result.finish_reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {result.finish_reason!r}")
    return result.finish_reason


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
