"""Parse and validate one batch input line into a `BatchRequest` or a `LineError`.

Two line shapes are accepted: Conveyor's `{"custom_id", "body"}` and OpenAI's
`{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body"}`. The body holds
`messages` or `prompt` plus sampling parameters under OpenAI's names or the engine's; they are mapped to
`engine.SamplingParams` keyword arguments and checked by it (its bounds are the API's too). What the API
checks beyond the engine applies here as well (core/request_rules.py): text the store can hold, at most
MAX_STOP_STRINGS stop strings and MAX_STOP_TOKEN_IDS stop token ids, logprobs up to MAX_LOGPROBS, and a
prompt refused by its size before it is tokenized.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from core.request_rules import (
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    PROMPT_BYTES_PER_TOKEN,
    text_problem,
    utf8_length,
)
from worker.batches.reader import OversizeLine, RawLine
from worker.batches.structured import STRUCTURED_FIELDS, merge_structured
from worker.sampling import sampling_params_from_json

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)
MAX_CUSTOM_ID_CHARS = 512

_LINE_FIELDS = {"custom_id", "body", "method", "url"}
_ROLES = {"system", "developer", "user", "assistant", "tool"}
# Body fields that carry no sampling parameter: checked, then dropped.
_PASSIVE_FIELDS = {"model", "user", "stream", "n", "messages", "prompt"}
_INT_PARAMS = {"max_tokens", "max_completion_tokens", "min_tokens", "top_k", "seed", "top_logprobs"}
_FLOAT_PARAMS = {"temperature", "top_p", "min_p", "repetition_penalty"}
_OTHER_PARAMS = {"stop", "stop_token_ids", "ignore_eos", "logprobs", *STRUCTURED_FIELDS}
_BODY_FIELDS = _PASSIVE_FIELDS | _INT_PARAMS | _FLOAT_PARAMS | _OTHER_PARAMS


@dataclass(frozen=True)
class BatchRequest:
    line: int
    custom_id: str
    endpoint: str  # CHAT or COMPLETIONS
    messages: list[dict[str, str]] | None
    prompt: str | list[int] | None  # text, or token ids
    params: dict[str, Any]  # engine.SamplingParams keyword arguments, only those the line set
    model: str | None


@dataclass(frozen=True)
class LineError:
    line: int
    custom_id: str | None
    code: str
    message: str


class LineRejected(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class CustomIdSet:
    """The custom_ids seen so far in one batch; the caller keeps one per batch (a set is fine even for
    millions of lines) and rebuilds it from the store when resuming."""

    def __init__(self, seen: set[str] | None = None) -> None:
        self._seen = set(seen or ())

    def add(self, custom_id: str) -> bool:
        """True if new; False if this batch already had it."""
        if custom_id in self._seen:
            return False
        self._seen.add(custom_id)
        return True

    def __contains__(self, custom_id: object) -> bool:
        return custom_id in self._seen

    def __len__(self) -> int:
        return len(self._seen)


@dataclass(frozen=True)
class LineLimits:
    """Checks that depend on the queue and the model: the batch's endpoint (None: either), the prompt
    length counted by `count_tokens`, and the output length."""

    endpoint: str | None = None
    max_prompt_tokens: int | None = None
    count_tokens: Callable[[BatchRequest], int] | None = None
    max_output_tokens: int | None = None


def parse_line(number: int, raw: RawLine, seen: CustomIdSet, limits: LineLimits | None = None,
               ) -> BatchRequest | LineError:
    limits = limits or LineLimits()
    custom_id: str | None = None
    try:
        line = _decode(raw)
        custom_id = _custom_id(line)
        if not seen.add(custom_id):
            raise LineRejected("duplicate_custom_id", f"custom_id {custom_id!r} appears more than once")
        request = _request(number, custom_id, line, limits)
        _check_lengths(request, limits)
        return request
    except LineRejected as error:
        return LineError(number, custom_id, error.code, str(error))


def _decode(raw: RawLine) -> dict[str, Any]:
    if isinstance(raw, OversizeLine):
        raise LineRejected("line_too_long", f"line is longer than {raw.limit} bytes")
    try:
        line = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise LineRejected("invalid_json", f"line is not valid JSON: {error}") from None
    except RecursionError:  # raised, not refused, it would fail the round and the line be read again forever
        raise LineRejected("invalid_json", "line is nested too deeply") from None
    if not isinstance(line, dict):
        raise LineRejected("invalid_json", "line must be a JSON object")
    return line


def _custom_id(line: dict[str, Any]) -> str:
    if "custom_id" not in line:
        raise LineRejected("missing_custom_id", "custom_id is required")
    custom_id = line["custom_id"]
    if not isinstance(custom_id, str) or not custom_id:
        raise LineRejected("invalid_custom_id", f"custom_id must be a non-empty string, got {custom_id!r}")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise LineRejected("invalid_custom_id", f"custom_id must be at most {MAX_CUSTOM_ID_CHARS} characters")
    _check_text("invalid_custom_id", "custom_id", custom_id)
    return custom_id


def _check_text(code: str, name: str, text: str) -> None:
    """Text the line's job (or its error) would store: no NUL, no lone surrogates."""
    problem = text_problem(text)
    if problem is not None:
        raise LineRejected(code, f"{name} {problem}")


def _shown(name: str) -> str:
    """A name from the line, safe to store in an error message."""
    return name if text_problem(name) is None else ascii(name)


def _request(number: int, custom_id: str, line: dict[str, Any], limits: LineLimits) -> BatchRequest:
    unknown = sorted(set(line) - _LINE_FIELDS)
    if unknown:
        raise LineRejected("invalid_line", f"unknown line fields: {', '.join(map(_shown, unknown))}")
    if line.get("method", "POST") != "POST":
        raise LineRejected("invalid_method", f"method must be 'POST', got {line['method']!r}")
    body = line.get("body")
    if not isinstance(body, dict):
        raise LineRejected("invalid_body", "body must be a JSON object")
    endpoint = _endpoint(line.get("url"), body, limits.endpoint)
    return BatchRequest(line=number, custom_id=custom_id, endpoint=endpoint, messages=_messages(body),
                        prompt=_prompt(body), params=_sampling_params(body), model=_model(body))


def _endpoint(url: object, body: dict[str, Any], batch_endpoint: str | None) -> str:
    if url is not None and url not in ENDPOINTS:
        raise LineRejected("invalid_url", f"url must be one of {', '.join(ENDPOINTS)}, got {url!r}")
    if url is not None and batch_endpoint is not None and url != batch_endpoint:
        raise LineRejected("invalid_url", f"url {url!r} differs from the batch endpoint {batch_endpoint!r}")
    has_messages, has_prompt = "messages" in body, "prompt" in body
    if has_messages == has_prompt:
        raise LineRejected("invalid_body", "body must hold exactly one of messages or prompt")
    endpoint = url or batch_endpoint or (CHAT if has_messages else COMPLETIONS)
    if (endpoint == CHAT) != has_messages:
        wanted = "messages" if endpoint == CHAT else "prompt"
        raise LineRejected("invalid_body", f"{endpoint} needs {wanted} in the body")
    return str(endpoint)


def _messages(body: dict[str, Any]) -> list[dict[str, str]] | None:
    if "messages" not in body:
        return None
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise LineRejected("invalid_body", "messages must be a non-empty list")
    return [_message(i, message) for i, message in enumerate(messages)]


def _message(index: int, message: object) -> dict[str, str]:
    if not isinstance(message, dict) or message.get("role") not in _ROLES:
        roles = ", ".join(sorted(_ROLES))
        raise LineRejected("invalid_body", f"messages[{index}] must be an object with a role in {roles}")
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts: only text is supported
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise LineRejected("invalid_body", f"messages[{index}].content parts must all be text parts")
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise LineRejected("invalid_body", f"messages[{index}].content must be a string or text parts")
    _check_text("invalid_body", f"messages[{index}].content", content)
    return {"role": message["role"], "content": content}


def _prompt(body: dict[str, Any]) -> str | list[int] | None:
    if "prompt" not in body:
        return None
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # OpenAI allows a list of prompts; one line carries one
    if isinstance(prompt, str) and prompt:
        _check_text("invalid_body", "prompt", prompt)
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return list(prompt)
    raise LineRejected("invalid_body", "prompt must be a non-empty string or a list of token ids")


def _model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise LineRejected("invalid_parameter", "model must be a string")
    if model is not None:
        _check_text("invalid_parameter", "model", model)  # stored in the job's metadata
    return model


def _sampling_params(body: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(body) - _BODY_FIELDS)
    if unknown:
        raise LineRejected("invalid_parameter", f"unknown body fields: {', '.join(map(_shown, unknown))}")
    if body.get("n", 1) != 1:
        raise LineRejected("invalid_parameter", f"n must be 1, got {body['n']!r}")
    if body.get("stream", False) is not False:
        raise LineRejected("invalid_parameter", "stream must be false in a batch")
    params = {name: body[name] for name in body.keys() - _PASSIVE_FIELDS}
    _check_types(params)
    _check_lists(params)
    _merge_max_tokens(params)
    _merge_logprobs(params)
    try:
        merge_structured(params)
        sampling_params_from_json(params)
    except ValueError as error:
        raise LineRejected("invalid_parameter", str(error)) from None
    return params


def _check_types(params: dict[str, Any]) -> None:
    for name, value in params.items():
        if name in _INT_PARAMS and value is not None and not _is_int(value):
            raise LineRejected("invalid_parameter", f"{name} must be an integer, got {value!r}")
        if name in _FLOAT_PARAMS and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise LineRejected("invalid_parameter", f"{name} must be a number, got {value!r}")
    if not isinstance(params.get("ignore_eos", False), bool):
        raise LineRejected("invalid_parameter", "ignore_eos must be a boolean")
    stop = params.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise LineRejected("invalid_parameter", "stop must be a string or a list of strings")
    if not isinstance(params.get("stop_token_ids", []), list):
        raise LineRejected("invalid_parameter", "stop_token_ids must be a list of token ids")
    for name in ("seed", "stop"):
        if name in params and params[name] is None:
            del params[name]


def _check_lists(params: dict[str, Any]) -> None:
    """The API's limits on stop strings and stop token ids (the engine takes any number)."""
    stop = params.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > MAX_STOP_STRINGS:
        raise LineRejected("invalid_parameter", f"stop must hold at most {MAX_STOP_STRINGS} strings")
    for index, text in enumerate(stops):
        if isinstance(text, str):  # the engine refuses anything else
            _check_text("invalid_parameter", f"stop[{index}]" if isinstance(stop, list) else "stop", text)
    if len(params.get("stop_token_ids", [])) > MAX_STOP_TOKEN_IDS:
        raise LineRejected("invalid_parameter",
                           f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} token ids")


def _merge_max_tokens(params: dict[str, Any]) -> None:
    legacy, current = params.pop("max_tokens", None), params.pop("max_completion_tokens", None)
    if legacy is not None and current is not None and legacy != current:
        raise LineRejected("invalid_parameter", "max_tokens and max_completion_tokens disagree")
    value = current if current is not None else legacy
    if value is not None:
        params["max_tokens"] = value


def _merge_logprobs(params: dict[str, Any]) -> None:
    """Chat: `logprobs: bool` plus `top_logprobs: int`; completions and the engine: `logprobs: int`."""
    logprobs, top = params.pop("logprobs", None), params.pop("top_logprobs", None)
    if isinstance(logprobs, bool):
        if top is not None and not logprobs:
            raise LineRejected("invalid_parameter", "top_logprobs needs logprobs set to true")
        logprobs = (top or 0) if logprobs else None
    elif top is not None:
        raise LineRejected("invalid_parameter", "top_logprobs needs logprobs set to true")
    elif logprobs is not None and not _is_int(logprobs):
        raise LineRejected("invalid_parameter", f"logprobs must be a boolean or an integer, got {logprobs!r}")
    if logprobs is not None and _is_int(logprobs) and logprobs > MAX_LOGPROBS:
        raise LineRejected("invalid_parameter", f"logprobs must be at most {MAX_LOGPROBS}, got {logprobs}")
    if logprobs is not None:
        params["logprobs"] = logprobs


def _check_lengths(request: BatchRequest, limits: LineLimits) -> None:
    max_tokens, cap = request.params.get("max_tokens"), limits.max_output_tokens
    if cap is not None and max_tokens is not None and max_tokens > cap:
        raise LineRejected("invalid_parameter", f"max_tokens must be <= {cap} here, got {max_tokens}")
    if limits.max_prompt_tokens is None:
        return
    _check_prompt_bytes(request, limits.max_prompt_tokens)
    if limits.count_tokens is None:
        return
    try:
        tokens = limits.count_tokens(request)
    except ValueError as error:  # e.g. a chat template that rejects the messages
        raise LineRejected("invalid_body", str(error)) from None
    if tokens > limits.max_prompt_tokens:
        raise LineRejected("prompt_too_long",
                           f"prompt has {tokens} tokens, more than the queue's {limits.max_prompt_tokens}")


def _check_prompt_bytes(request: BatchRequest, max_prompt_tokens: int) -> None:
    """Refuses a text prompt that cannot fit max_prompt_tokens by its size alone, before tokenizing it."""
    if isinstance(request.prompt, list):  # token ids: counted exactly anyway
        return
    size = utf8_length(request.prompt or "") + sum(utf8_length(m["content"]) for m in request.messages or [])
    limit = max_prompt_tokens * PROMPT_BYTES_PER_TOKEN
    if size > limit:
        raise LineRejected("prompt_too_long", f"prompt has {size} bytes, more than the queue's limit of "
                           f"{limit} (max_prompt_tokens {max_prompt_tokens} x {PROMPT_BYTES_PER_TOKEN} bytes "
                           "per token)")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
