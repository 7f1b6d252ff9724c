"""Parse and validate one batch input line into a `BatchRequest` or a `LineError`.

Two line shapes are accepted: Conveyor's `{"custom_id", "body"}` and OpenAI's
`{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body"}`. The body is
held to the rules of the synchronous routes, defined once in core/openai_request.py: the same fields, bounds
and refusals (`n` > 1, an unknown `model`, a chat role the model's template cannot render), each a line error
naming the field while the rest of the batch runs. Prompt and output lengths are held to the batch queue's
limits and the model's context by the request rules every door shares (core/request_limits.py: a prompt is
refused by its size before it is tokenized). What only a batch adds: `stream` must be false, a line's url
must match the batch's endpoint, and the engine checks the resulting parameters last.

Nothing about one line can fail the batch: an integer literal longer than MAX_INT_DIGITS is refused before
it is converted, and any other exception while judging a line (a bug, or a tokenizer or chat template
failing in a way nobody foresaw) becomes that line's `invalid_line` error, logged with its traceback.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from core.chat_options import ChatOptions
from core.chat_options import job_params as chat_job_params
from core.field_errors import FieldProblem
from core.openai_request import (
    CHAT,
    CHAT_FIELDS,
    COMPLETIONS,
    QUEUE_FIELDS,
    STRUCTURED_FIELDS,
    ChatCompletionCreate,
    OpenAIRequest,
    Refusal,
    Served,
    check_request,
    parse_body,
)
from core.request_limits import RequestLimits, RequestSize, size_problem, tokenizer_problem, tokens_problem
from core.request_rules import MAX_INT_DIGITS, text_problem
from core.service_tiers import PriorityNotPermitted, PriorityRange
from worker.batches.reader import OversizeLine, RawLine
from worker.sampling import sampling_params_from_json

log = logging.getLogger(__name__)

ENDPOINTS = (CHAT, COMPLETIONS)
MAX_CUSTOM_ID_CHARS = 512

_LINE_FIELDS = {"custom_id", "body", "method", "url"}
_BODY_PARAMS = ("messages", "prompt")  # a refusal naming them is invalid_body, others invalid_parameter


@dataclass(frozen=True)
class BatchRequest:
    line: int
    custom_id: str
    endpoint: str  # CHAT or COMPLETIONS
    messages: list[dict[str, Any]] | None
    prompt: str | list[int] | None  # text (token ids are refused, as on the synchronous route)
    params: dict[str, Any]  # engine.SamplingParams keyword arguments, only those the line set
    model: str | None
    prompt_tokens: int = 0  # as the queue's tokenizer counts them (0 when the parser was given none)
    lane: str | None = None  # where its job is queued (core/lanes.py): its model's queue; None: not said
    chat: dict[str, Any] | None = None  # how the messages are rendered and the answer read (stored form)
    shown: dict[str, Any] | None = None  # what its answer shows of the prompt (PromptView's stored form)
    priority: int = 0  # lower first
    deadline_s: float | None = None  # None: the batch's completion window is its deadline
    service_tier: str | None = None  # echoed in its answer; flex takes no default deadline

    def size(self) -> RequestSize:
        """The lengths the request rules judge."""
        prompt = self.prompt if isinstance(self.prompt, str) else None  # token ids: counted exactly anyway
        template_bytes = ChatOptions.from_json(self.chat).template_bytes()
        return RequestSize(prompt, self.messages, self.params.get("max_tokens"),
                           self.params.get("min_tokens", 0), template_bytes)


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
    length counted by `count_tokens`, the output length, and what is served (`model` names, chat roles;
    by default any model, and the roles of a template that names neither developer nor tool)."""

    endpoint: str | None = None
    max_prompt_tokens: int | None = None
    count_tokens: Callable[[BatchRequest], int] | None = None
    max_output_tokens: int | None = None
    served: Served = field(default_factory=Served)
    max_model_len: int | None = None  # prompt + max_tokens must fit it, as at the synchronous routes
    queue: str | None = None  # the batch's queue, named in nothing but the limits' own messages
    lane: str | None = None  # the line's model's queue of that name (core/lanes.py), where its job goes
    priorities: PriorityRange = field(default_factory=PriorityRange)  # the batch's tenant may ask for

    def request_limits(self) -> RequestLimits:
        return RequestLimits(self.queue, self.max_prompt_tokens, self.max_output_tokens, self.max_model_len)


LimitsOfModel = Callable[[str | None], LineLimits]  # the limits of the model a line names (None: the default)


def parse_line(number: int, raw: RawLine, seen: CustomIdSet, limits: LineLimits | LimitsOfModel | None = None,
               ) -> BatchRequest | LineError:
    """`limits`: one set for every line, or the limits of the model each line names (LookupError for a model
    not served: the line's `model_not_found`; a LineRejected: that line error)."""
    custom_id: str | None = None
    try:
        line = _decode(raw)
        custom_id = _custom_id(line)
        if not seen.add(custom_id):
            raise LineRejected("duplicate_custom_id", f"custom_id {custom_id!r} appears more than once")
        chosen = _limits_of_line(line, limits)
        request = _counted(_request(number, custom_id, line, chosen), chosen)
        _check_engine_params(request.params)
        return replace(request, lane=chosen.lane)
    except LineRejected as error:
        return LineError(number, custom_id, error.code, str(error))
    except Exception as error:  # a line must never fail its batch, whatever judging it raised
        log.exception("batch line %d: judging it raised %s", number, type(error).__name__)
        return LineError(number, custom_id, "invalid_line",
                         f"the line could not be judged: {type(error).__name__}")


def _limits_of_line(line: dict[str, Any], limits: LineLimits | LimitsOfModel | None) -> LineLimits:
    if limits is None or isinstance(limits, LineLimits):
        return limits or LineLimits()
    body = line.get("body")
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str) or text_problem(model) is not None:
        model = None  # the default model's limits: the body's own checks refuse such a model, naming it
    try:
        return limits(model)
    except LookupError as exc:
        raise LineRejected("model_not_found", str(exc)) from None


def _decode(raw: RawLine) -> dict[str, Any]:
    if isinstance(raw, OversizeLine):
        raise LineRejected("line_too_long", f"line is longer than {raw.limit} bytes")
    try:
        line = json.loads(raw, parse_int=_bounded_int)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise LineRejected("invalid_json", f"line is not valid JSON: {error}") from None
    except RecursionError:  # raised, not refused, it would fail the round and the line be read again forever
        raise LineRejected("invalid_json", "line is nested too deeply") from None
    if not isinstance(line, dict):
        raise LineRejected("invalid_json", "line must be a JSON object")
    return line


def _bounded_int(literal: str) -> int:
    """An integer literal of the line, converted only when it is short enough to be any field's value."""
    digits = len(literal) - literal.startswith("-")
    if digits > MAX_INT_DIGITS:
        raise LineRejected("invalid_json", f"line holds an integer of {digits} digits; at most "
                           f"{MAX_INT_DIGITS} are read (no field takes more than 19)")
    return int(literal)


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
    try:
        return _validated(number, custom_id, endpoint, body, limits.served, limits.priorities)
    except Refusal as refusal:
        raise LineRejected(_line_code(refusal), refusal.message) from None


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


def _validated(number: int, custom_id: str, endpoint: str, body: dict[str, Any], served: Served,
               priorities: PriorityRange) -> BatchRequest:
    """The synchronous route's rules (core/openai_request.py), then what only a batch adds."""
    request = parse_body(endpoint, body)
    check_request(request, served)
    if request.stream:
        raise Refusal("invalid", "stream", "must be false in a batch")
    if request.on_deadline_miss == "reject":
        raise Refusal("unsupported", "on_deadline_miss", "on_deadline_miss: reject is answered at submit "
                      "(the jobs API, the OpenAI routes); a batch line runs within its batch's completion "
                      "window, late or not")
    options = ChatOptions()
    if isinstance(request, ChatCompletionCreate):
        messages, prompt = request.chat_messages(served.roles), None
        options = request.chat_options(served.tool_parser)  # judged by check_request
    else:
        messages, prompt = None, request.prompt_text()
    try:
        priority = priorities.job_priority(request.service_tier, request.priority)
    except PriorityNotPermitted as exc:
        raise LineRejected("priority_not_permitted", str(exc)) from None
    return BatchRequest(line=number, custom_id=custom_id, endpoint=endpoint, messages=messages, prompt=prompt,
                        params=chat_job_params(_job_params(request), options), model=request.model,
                        chat=options.to_json(), shown=request.prompt_view().to_json(), priority=priority,
                        deadline_s=request.deadline_s, service_tier=request.service_tier)


def _job_params(request: OpenAIRequest) -> dict[str, Any]:
    """The job's stored params (structured output in its stored form), as the line set them."""
    params = request.job_params()
    for name in (*STRUCTURED_FIELDS, *CHAT_FIELDS, *QUEUE_FIELDS):
        params.pop(name, None)
    structured = request.structured()  # checked by check_request
    if structured is not None:
        params["structured"] = structured
    max_tokens = request.requested_max_tokens()
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    return params


def _check_engine_params(params: dict[str, Any]) -> None:
    """Last, the engine's own rules over the params the job will run with."""
    try:
        sampling_params_from_json(params)
    except ValueError as error:
        raise LineRejected("invalid_parameter", str(error)) from None


def _line_code(refusal: Refusal) -> str:
    """The batch error code of a refusal the synchronous route answers with 400 (404: model_not_found)."""
    if refusal.kind == "model_not_found":
        return "model_not_found"
    root = (refusal.param or "").split("[")[0].split(".")[0]
    return "invalid_body" if refusal.param is None or root in _BODY_PARAMS else "invalid_parameter"


def _counted(request: BatchRequest, limits: LineLimits) -> BatchRequest:
    """The request rules every door shares (core/request_limits.py), with the prompt's tokens counted
    between the two steps; the request carries its count."""
    size, rules = request.size(), limits.request_limits()
    _reject(size_problem(size, rules))
    if limits.count_tokens is None:
        return request
    try:
        tokens = limits.count_tokens(request)
    except ValueError as error:  # e.g. a chat template that rejects the messages
        raise _rejected(tokenizer_problem(size, error)) from None
    _reject(tokens_problem(size, tokens, rules))
    return replace(request, prompt_tokens=tokens)


def _reject(problem: FieldProblem | None) -> None:
    if problem is not None:
        raise _rejected(problem)


def _rejected(problem: FieldProblem) -> LineRejected:
    return LineRejected(problem.line_code, problem.line_message)
