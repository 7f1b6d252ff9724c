"""The limits every request is held to, whichever way it came in (POST /v1/jobs, the OpenAI routes, a batch
line): one place decides, each door only answers. Each rule returns the `FieldProblem` naming the field, or
None; api/submit.py answers a problem with its 422 (OpenAI's 400 on those routes), worker/batches/lines.py
with a line error.

Judged in two steps, so that a request too big to run costs no tokenization:
1. `size_problem`, before tokenizing: the prompt's UTF-8 bytes against max_prompt_tokens x
   PROMPT_BYTES_PER_TOKEN, a token-id prompt's ids against the model's vocabulary, max_tokens against the
   queue's max_output_tokens, min_tokens against max_tokens;
2. `tokens_problem`, once the prompt is counted: its tokens against max_prompt_tokens, then prompt +
   max_tokens against the served model's context (core/protocol/model_limits.py).
A completion with several prompts (core/protocol/completion_prompts.py) is judged prompt by prompt
(`prompt_sizes`): each is a sequence of its own in the engine, named `prompt[i]` in a refusal.
The other fields' rules are the request schemas' types (core/protocol/request_fields.py) and the
structured-output rules (core/protocol/structured_rules.py), which every door's schema shares.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from conveyor.core.protocol.completion_prompts import Prompts
from conveyor.core.protocol.field_errors import FieldProblem
from conveyor.core.protocol.request_rules import PROMPT_BYTES_PER_TOKEN, text_problem, utf8_length
from conveyor.core.settings import QueueSettings

MAX_IDEMPOTENCY_KEY_CHARS = 255  # the store's column


@dataclass(frozen=True)
class RequestLimits:
    """What a request is held to: its queue's limits (None: not limited, as for a batch line parsed without
    a queue), the context the workers serve and the model's vocabulary (None: not known)."""

    queue: str | None = None
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    max_model_len: int | None = None
    vocab_size: int | None = None

    @classmethod
    def of_queue(cls, name: str, queue: QueueSettings, max_model_len: int | None,
                 vocab_size: int | None = None) -> RequestLimits:
        return cls(name, queue.max_prompt_tokens, queue.max_output_tokens, max_model_len, vocab_size)

    @property
    def queue_s(self) -> str:
        """ "the interactive queue's", or "the queue's" when no queue is named."""
        return f"the {self.queue} queue's" if self.queue is not None else "the queue's"


@dataclass(frozen=True)
class RequestSize:
    """What a request asks of its queue and model: a prompt (text, token ids, or chat messages whose contents
    the chat template only adds to) and an output."""

    prompt: str | None
    messages: list[dict[str, Any]] | None
    max_tokens: int | None  # None: not sent (a batch line then runs the engine's default)
    min_tokens: int = 0
    template_bytes: int = 0  # what the chat template adds beside the messages: tools, its variables
    token_ids: list[int] | None = None  # a prompt sent as token ids: its tokens as they are, nothing added
    named: str = "prompt"  # what a refusal calls the prompt: `prompt`, or `prompt[i]` of several

    @property
    def prompt_field(self) -> str:
        return "messages" if self.messages is not None else self.named

    @property
    def prompt_bytes(self) -> int:
        messages = sum(_message_bytes(m) for m in self.messages or [])
        return utf8_length(self.prompt or "") + messages + self.template_bytes


def _message_bytes(message: dict[str, Any]) -> int:
    calls = message.get("tool_calls") or []
    arguments = sum(utf8_length(c["function"]["name"] + c["function"]["arguments"]) for c in calls)
    return utf8_length(message.get("content") or "") + arguments


def prompt_sizes(prompts: Prompts, max_tokens: int | None, min_tokens: int = 0) -> list[RequestSize]:
    """A completion's prompts as the rules judge them: one size each, named as it was sent."""
    return [RequestSize(item if isinstance(item, str) else None, None, max_tokens, min_tokens,
                        token_ids=item if isinstance(item, list) else None, named=prompts.name(index))
            for index, item in enumerate(prompts.items)]


def size_problem(size: RequestSize, limits: RequestLimits) -> FieldProblem | None:
    """What is judged before tokenizing: the prompt's bytes or token ids, max_tokens, min_tokens."""
    return (prompt_bytes_problem(size, limits) or vocabulary_problem(size, limits)
            or output_problem(size, limits) or min_tokens_problem(size))


def tokens_problem(size: RequestSize, prompt_tokens: int, limits: RequestLimits) -> FieldProblem | None:
    """What is judged once the prompt is counted: its tokens, then prompt + output against the context."""
    return prompt_tokens_problem(size, prompt_tokens, limits) or context_problem(size, prompt_tokens, limits)


def prompt_bytes_problem(size: RequestSize, limits: RequestLimits) -> FieldProblem | None:
    """A prompt that cannot fit max_prompt_tokens by its size alone (core/protocol/request_rules.py says
    why)."""
    if limits.max_prompt_tokens is None:
        return None
    limit = limits.max_prompt_tokens * PROMPT_BYTES_PER_TOKEN
    if size.prompt_bytes <= limit:
        return None
    field = size.prompt_field
    message = (f"{field}: {size.prompt_bytes} bytes exceeds {limits.queue_s} limit of {limit} bytes "
               f"(max_prompt_tokens {limits.max_prompt_tokens} x {PROMPT_BYTES_PER_TOKEN} bytes per token)")
    return FieldProblem(field, "prompt_too_long", message, "prompt_too_long", message)


def vocabulary_problem(size: RequestSize, limits: RequestLimits) -> FieldProblem | None:
    """A token-id prompt naming a token the model does not have (the first such, by its place)."""
    vocab, ids = limits.vocab_size, size.token_ids or []
    position = next((i for i, token in enumerate(ids) if vocab is not None and token >= vocab), None)
    if position is None:
        return None
    assert vocab is not None
    field = f"{size.named}[{position}]"
    message = f"{field}: token id {ids[position]} is not in the model's vocabulary (0 to {vocab - 1})"
    return FieldProblem(field, "invalid_request", message, "invalid_body", message)


def output_problem(size: RequestSize, limits: RequestLimits) -> FieldProblem | None:
    cap, wanted = limits.max_output_tokens, size.max_tokens
    if cap is None or wanted is None or wanted <= cap:
        return None
    message = f"max_tokens: {wanted} exceeds {limits.queue_s} max_output_tokens ({cap})"
    line_message = f"max_tokens: must be <= {cap} here, got {wanted}"
    return FieldProblem("max_tokens", "max_tokens_too_large", message, "invalid_parameter", line_message)


def min_tokens_problem(size: RequestSize) -> FieldProblem | None:
    if size.max_tokens is None or size.min_tokens <= size.max_tokens:
        return None
    message = f"min_tokens: {size.min_tokens} exceeds max_tokens ({size.max_tokens})"
    return FieldProblem("min_tokens", "invalid_request", message, "invalid_parameter", message)


def prompt_tokens_problem(size: RequestSize, prompt_tokens: int, limits: RequestLimits,
                          ) -> FieldProblem | None:
    cap = limits.max_prompt_tokens
    if cap is None or prompt_tokens <= cap:
        return None
    field = size.prompt_field
    message = f"{field}: {prompt_tokens} tokens exceeds {limits.queue_s} max_prompt_tokens ({cap})"
    line_message = f"{field}: {prompt_tokens} tokens, more than the queue's {cap}"
    return FieldProblem(field, "prompt_too_long", message, "prompt_too_long", line_message)


def context_problem(size: RequestSize, prompt_tokens: int, limits: RequestLimits) -> FieldProblem | None:
    """Prompt + max_tokens beyond what the workers serve: a request that could never run."""
    context, wanted = limits.max_model_len, size.max_tokens
    if context is None or wanted is None or prompt_tokens + wanted <= context:
        return None
    prompt = "" if size.named == "prompt" else f" ({size.named})"
    message = (f"max_tokens: {prompt_tokens} prompt tokens{prompt} + max_tokens {wanted} exceeds "
               f"max_model_len ({context})")
    return FieldProblem("max_tokens", "context_too_long", message, "context_too_long", message)


def tokenizer_problem(size: RequestSize, error: ValueError) -> FieldProblem:
    """The tokenizer refused the prompt (a chat template rejecting the messages, or none to render them)."""
    return FieldProblem(size.prompt_field, "invalid_request", str(error), "invalid_body", str(error))


def metadata_problem(metadata: dict[str, Any] | None, max_bytes: int) -> FieldProblem | None:
    """A job's metadata beyond max_metadata_bytes of compact JSON (only the job API takes metadata)."""
    if metadata is None:
        return None
    size = len(json.dumps(metadata, separators=(",", ":")).encode())
    if size <= max_bytes:
        return None
    message = f"metadata: {size} bytes of JSON exceeds {max_bytes}"
    return FieldProblem("metadata", "metadata_too_large", message, "invalid_body", message)


def idempotency_key_problem(key: str) -> FieldProblem | None:
    """An Idempotency-Key the store cannot keep (only the job API takes one, as a header)."""
    reason = text_problem(key)  # the key is stored
    if not key or len(key) > MAX_IDEMPOTENCY_KEY_CHARS:
        reason = f"must be 1 to {MAX_IDEMPOTENCY_KEY_CHARS} characters"
    if reason is None:
        return None
    message = f"Idempotency-Key: {reason}"
    return FieldProblem("Idempotency-Key", "invalid_request", message, "invalid_request", message)
