"""OpenAI-shaped objects built from a plain generation result: `chat.completion` and `text_completion` bodies
and their streamed chunks. Pure builders shared by the HTTP chat/completions routes and the batch writer
(core/views/openai_objects.py re-exports the body builders)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from conveyor.core.protocol.chat_options import ChatOptions
from conveyor.core.views.tool_calls import choice_seed, read_output

FINISH_REASONS = ("stop", "length")
TOOL_CALLS = "tool_calls"  # the finish_reason of an answer that calls tools


@dataclass(frozen=True)
class PromptView:
    """What an answer shows of its prompt: completions' `echo` (the prompt before each choice's text, and
    with logprobs its tokens' logprobs with echo_top_n alternatives) and vLLM's `prompt_logprobs`."""

    echo: bool = False
    echo_top_n: int | None = None
    vllm_top_n: int | None = None

    def to_json(self) -> dict[str, Any] | None:
        shown = {name: value for name, value in vars(self).items() if value not in (None, False)}
        return shown or None

    @classmethod
    def from_json(cls, stored: dict[str, Any] | None) -> PromptView:
        """The stored form read back; keys this version does not know are left out."""
        known = set(vars(cls()))
        return cls(**{name: value for name, value in (stored or {}).items() if name in known})


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
    draft_tokens: int = 0  # tokens speculative decoding drafted, over every choice
    accepted_draft_tokens: int = 0  # of those, the ones the model accepted
    chat: ChatOptions = field(default_factory=ChatOptions)  # how a chat answer is read (its tool calls)
    job_id: str = ""  # names its tool calls (core/views/tool_calls.py)
    # A job with n > 1, or whose prompts are token ids or several: every choice as it stores them {index,
    # text, finish_reason, logprobs, prompt, ...}; the fields above are choice 0's (completion_tokens: all).
    choices: list[dict[str, Any]] | None = None
    prompt: str = ""  # the prompt's text (shown with echo)
    prompt_logprobs: list[dict[str, Any]] | None = None  # as the job stores them, when it asked
    shown: PromptView = field(default_factory=PromptView)
    service_tier: str | None = None  # echoed when the request named one

    def each_choice(self) -> list[Choice]:
        if not self.choices:
            return [Choice(0, self.text, self.finish_reason, self.logprobs)]
        return [Choice(c["index"], c["text"], c["finish_reason"], c.get("logprobs"),
                       PromptRead.of(c.get("prompt"))) for c in self.choices]

    def choice_prompts(self) -> list[PromptRead]:
        """The prompt each choice answers, in choice order: its text and, when asked, its tokens' logprobs. A
        job whose prompts are token ids or several keeps each in the first of its n choices (choice i answers
        prompt i // n); otherwise every choice answers the job's one `prompt`."""
        each = self.each_choice()
        read = [choice.prompt for choice in each if choice.prompt is not None]
        if not read:
            return [PromptRead(self.prompt, self.prompt_logprobs)] * len(each)
        per_prompt = len(each) // len(read)  # n
        return [read[choice.index // per_prompt] for choice in each]


@dataclass(frozen=True)
class PromptRead:
    """A prompt as the worker read it and echo shows it: its text (token ids decoded), and per token
    {token_id, text, logprob, top_logprobs} (the first logprob null) when the job scored it."""

    text: str
    logprobs: list[dict[str, Any]] | None

    @classmethod
    def of(cls, stored: dict[str, Any] | None) -> PromptRead | None:
        """A stored choice's `prompt` ({text, logprobs}) read back; None: the choice keeps none."""
        return cls(stored["text"], stored.get("logprobs")) if stored is not None else None


@dataclass(frozen=True)
class Choice:
    index: int
    text: str
    finish_reason: str
    logprobs: list[dict[str, Any]] | None
    prompt: PromptRead | None = None  # the prompt it answers, kept in the first choice of each prompt


def new_id(prefix: str) -> str:
    """`prefix` + 32 hex digits, e.g. new_id("batch_req_")."""
    return prefix + uuid.uuid4().hex


def usage(result: GenerationResult) -> dict[str, Any]:
    """OpenAI's usage object; prompt tokens found in the prefix cache under prompt_tokens_details and, when
    speculative decoding drafted tokens, the drafts under the names OpenAI gives a predicted output's tokens
    (completion_tokens stays the answer's own tokens: accepted drafts are among them, rejected ones not)."""
    prompt, completion = result.prompt_tokens, result.completion_tokens
    body: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                            "total_tokens": prompt + completion,
                            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}
    if result.draft_tokens:
        accepted = result.accepted_draft_tokens
        body["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                             "rejected_prediction_tokens": result.draft_tokens - accepted}
    return body


def chat_completion(result: GenerationResult, completion_id: str) -> dict[str, Any]:
    """A `chat.completion` object: one choice, or the job's n."""
    choices = [_chat_choice(result, choice) for choice in result.each_choice()]
    body = {"id": completion_id, "object": "chat.completion", "created": result.created,
            "model": result.model, "choices": choices, "usage": usage(result), **_tier(result.service_tier)}
    if result.shown.vllm_top_n is not None:  # vLLM puts a chat's prompt logprobs beside its choices
        body["prompt_logprobs"] = _vllm_prompt_logprobs(result.prompt_logprobs or [], result.shown.vllm_top_n)
    return body


def _chat_choice(result: GenerationResult, choice: Choice) -> dict[str, Any]:
    logprobs = _chat_logprobs(choice.logprobs) if choice.logprobs is not None else None
    read = read_output(choice.text, result.chat, choice_seed(result.job_id, choice.index))
    message: dict[str, Any] = {"role": "assistant", "content": read.content}
    if read.tool_calls:
        message["tool_calls"] = [call.as_openai() for call in read.tool_calls]
    return {"index": choice.index, "message": message, "logprobs": logprobs,
            "finish_reason": finish_reason(choice.finish_reason, called_tools=bool(read.tool_calls))}


def text_completion(result: GenerationResult, completion_id: str) -> dict[str, Any]:
    """A `text_completion` object: one choice, or n of each prompt."""
    choices = [_text_choice(result, choice, prompt)
               for choice, prompt in zip(result.each_choice(), result.choice_prompts(), strict=True)]
    return {"id": completion_id, "object": "text_completion", "created": result.created,
            "model": result.model, "choices": choices, "usage": usage(result), **_tier(result.service_tier)}


def _tier(service_tier: str | None) -> dict[str, str]:
    return {"service_tier": service_tier} if service_tier is not None else {}


def _text_choice(result: GenerationResult, choice: Choice, prompt: PromptRead) -> dict[str, Any]:
    """With echo the choice's prompt comes first, in the text and (with logprobs) in the logprobs."""
    shown = result.shown
    text, tokens = choice.text, choice.logprobs
    if shown.echo:
        text = prompt.text + text
    if shown.echo_top_n is not None and tokens is not None:
        prompt_tokens = [{**entry, "top_logprobs": entry["top_logprobs"][: shown.echo_top_n]}
                         for entry in prompt.logprobs or []]
        tokens = prompt_tokens + tokens
    body = {"index": choice.index, "text": text,
            "logprobs": _completion_logprobs(tokens) if tokens is not None else None,
            "finish_reason": finish_reason(choice.finish_reason)}
    if shown.vllm_top_n is not None:
        body["prompt_logprobs"] = _vllm_prompt_logprobs(prompt.logprobs or [], shown.vllm_top_n)
    return body


def _vllm_prompt_logprobs(entries: list[dict[str, Any]], top_n: int) -> list[dict[str, Any] | None]:
    """vLLM's shape: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}} for the
    token and its top_n alternatives; rank is known for the alternatives (1 = most likely), else null."""
    shaped: list[dict[str, Any] | None] = []
    for entry in entries:
        if entry["logprob"] is None:
            shaped.append(None)
            continue
        alternatives = entry["top_logprobs"][:top_n]
        ranks = {alt["token_id"]: rank for rank, alt in enumerate(alternatives, start=1)}
        tokens = {str(alt["token_id"]): alt for alt in [entry, *alternatives]}
        shaped.append({token_id: {"logprob": alt["logprob"], "rank": ranks.get(alt["token_id"]),
                                  "decoded_token": alt["text"]} for token_id, alt in tokens.items()})
    return shaped


def _chat_logprobs(tokens: list[dict[str, Any]]) -> dict[str, Any]:
    """Chat's shape: {"content": token_logprobs(tokens), "refusal": None}."""
    return {"content": token_logprobs(tokens), "refusal": None}


def token_logprobs(tokens: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per generated token {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}: chat's and the
    Responses API's shape of the tokens a job stores."""
    def one(entry: dict[str, Any]) -> dict[str, Any]:
        return {"token": entry["text"], "logprob": entry["logprob"], "bytes": list(entry["text"].encode())}

    return [{**one(t), "top_logprobs": [one(alt) for alt in t["top_logprobs"]]} for t in tokens]


def _completion_logprobs(tokens: list[dict[str, Any]]) -> dict[str, Any]:
    """Completions' shape: parallel lists of token texts, their logprobs, {text: logprob} alternatives and
    each token's character offset in the text (an echoed prompt's first token: null logprob and
    alternatives)."""
    texts = [t["text"] for t in tokens]
    offsets = [0, *accumulate(len(text) for text in texts)][: len(texts)]
    top = [None if t["logprob"] is None else {alt["text"]: alt["logprob"] for alt in t["top_logprobs"]}
           for t in tokens]
    return {"tokens": texts, "token_logprobs": [t["logprob"] for t in tokens], "top_logprobs": top,
            "text_offset": offsets}


@dataclass(frozen=True)
class ChunkHeader:
    """What every chunk of one streamed completion repeats."""

    completion_id: str
    model: str
    created: int
    chat: bool  # chat.completion.chunk, else text_completion
    service_tier: str | None = None  # echoed when the request named one


def chunk(header: ChunkHeader, text: str | None, finish: str | None = None, *, role: bool = False,
          usage_so_far: dict[str, Any] | None = None, index: int = 0) -> dict[str, Any]:
    """One streamed chunk of choice `index`: a text delta, a role opener or the closing finish_reason; with
    `usage_so_far` (vLLM's `stream_options.continuous_usage_stats`) the usage up to this chunk too."""
    if header.chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        return delta_chunk(header, delta, finish, usage_so_far=usage_so_far, index=index)
    choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
    return _with_usage(_chunk_body(header, [choice]), usage_so_far)


def delta_chunk(header: ChunkHeader, delta: dict[str, Any], finish: str | None = None,
                *, usage_so_far: dict[str, Any] | None = None, index: int = 0) -> dict[str, Any]:
    """A chat chunk of choice `index` whose delta is given (content, or tool_calls as
    core/views/tool_stream.py makes them)."""
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    return _with_usage(_chunk_body(header, [choice]), usage_so_far)


def _with_usage(body: dict[str, Any], usage_so_far: dict[str, Any] | None) -> dict[str, Any]:
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
            "choices": choices, **_tier(header.service_tier)}


def finish_reason(engine_reason: str, *, called_tools: bool = False) -> str:
    """OpenAI's finish_reason for the engine's: `tool_calls` for an answer that ended by calling tools."""
    if engine_reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {engine_reason!r}")
    return TOOL_CALLS if called_tools and engine_reason == "stop" else engine_reason


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
