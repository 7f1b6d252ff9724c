"""Parse and validate one batch input line into a `BatchRequest` or a `LineError`.

Two line shapes are accepted: Conveyor's `{"custom_id", "body"}` and OpenAI's `{"custom_id", "method":
"POST", "url": "/v1/chat/completions" | "/v1/completions" | "/v1/embeddings", "body"}` (without a url, the
body says which: `messages`, `prompt` or `input`). A Message Batch's lines (written by POST
/v1/messages/batches, the only batches of endpoint /v1/messages) take url "/v1/messages" and a Messages body:
it is read by Anthropic's rules (core/protocol/anthropic_request.py) into the chat request it asks for, which
is then judged exactly as a chat line. The body is held to the rules of the synchronous routes,
defined once in core/protocol/openai_request.py and core/protocol/embedding_request.py: the same fields,
bounds and refusals (`n` > 1, an unknown `model`, a chat role the model's template cannot render, an
embeddings line to a model that generates text), each a line error naming the field while the rest of the
batch runs. A completions line takes `prompt` in every shape /v1/completions takes
(core/protocol/completion_prompts.py: text, token ids, or several of either), each prompt judged on its own
and named `prompt[i]` when several were sent. An embeddings line's inputs are held to the model's limits by
core/protocol/embedding_rules.py, as POST /v1/embeddings holds them. Prompt and output lengths are held to
the batch queue's limits and the model's context by the request rules every door shares
(core/protocol/request_limits.py: a prompt is refused by its size before it is tokenized). What only a batch
adds: `stream` must be false, a line's url must match the batch's endpoint, and the engine checks the
resulting parameters last.

Nothing about one line can fail the batch: an integer literal longer than MAX_INT_DIGITS is refused before it
is converted, and any other exception while judging a line (a bug, or a tokenizer or chat template failing in
a way nobody foresaw) becomes that line's `invalid_line` error, logged with its traceback.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from conveyor.core.model_adapters import with_lora
from conveyor.core.protocol.anthropic_request import MESSAGES, parse_message_body
from conveyor.core.protocol.chat_options import ChatOptions
from conveyor.core.protocol.chat_options import job_params as chat_job_params
from conveyor.core.protocol.completion_prompts import Prompts
from conveyor.core.protocol.embedding_request import EMBEDDINGS, EmbeddingCreate, parse_embedding_body
from conveyor.core.protocol.embedding_rules import (
    EmbeddingLimits,
    embedded_tokens,
    input_lengths,
    inputs_problem,
    lengths_problem,
    task_problem,
)
from conveyor.core.protocol.field_errors import FieldProblem
from conveyor.core.protocol.job_kinds import EMBEDDING, GENERATION
from conveyor.core.protocol.job_params import JobParams
from conveyor.core.protocol.model_task import ModelTask
from conveyor.core.protocol.openai_request import (
    CHAT,
    CHAT_FIELDS,
    COMPLETIONS,
    QUEUE_FIELDS,
    STRUCTURED_FIELDS,
    ChatCompletionCreate,
    OpenAIRequest,
    Served,
    check_model,
    check_request,
    parse_body,
)
from conveyor.core.protocol.refusal import Refusal
from conveyor.core.protocol.request_limits import (
    RequestLimits,
    RequestSize,
    prompt_sizes,
    size_problem,
    tokenizer_problem,
    tokens_problem,
)
from conveyor.core.protocol.request_rules import MAX_INT_DIGITS, text_problem
from conveyor.core.protocol.service_tiers import PriorityNotPermitted, PriorityRange, ServiceTier
from conveyor.worker.batches.reader import OversizeLine, RawLine
from conveyor.worker.engine_requests import pooling_params_from_json
from conveyor.worker.sampling import sampling_params_from_json

log = logging.getLogger(__name__)

ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS, MESSAGES)
MAX_CUSTOM_ID_CHARS = 512
ENGINE_CHECKS_KEPT = 1024  # distinct params whose engine check is remembered

_LINE_FIELDS = {"custom_id", "body", "method", "url"}
# A refusal naming these is invalid_body, any other invalid_parameter.
_BODY_PARAMS = ("messages", "prompt", "input")


@dataclass(frozen=True)
class BatchRequest:
    line: int
    custom_id: str
    endpoint: str  # CHAT, COMPLETIONS or EMBEDDINGS
    messages: list[dict[str, Any]] | None
    # A completions line's one text prompt (its job's `prompt`); token ids only when each of several prompts
    # is counted as a line of its own (_counted)
    prompt: str | list[int] | None
    # its job's stored params (core/protocol/job_params.py), only those the line set (an embeddings line's:
    # core/protocol/embedding_request.py job_params)
    params: dict[str, Any]
    model: str | None
    prompt_tokens: int = 0  # as the queue's tokenizer counts them (0 when the parser was given none)
    lane: str | None = None  # where its job is queued (core/lanes.py): its model's queue; None: not said
    chat: dict[str, Any] | None = None  # how the messages are rendered and the answer read (stored form)
    shown: dict[str, Any] | None = None  # what its answer shows of the prompt (PromptView's stored form)
    priority: int = 0  # lower first
    deadline_s: float | None = None  # None: the batch's completion window is its deadline
    service_tier: str | None = None  # echoed in its answer; flex takes no default deadline
    # An embeddings line's inputs, or a completions line's prompts when they are token ids or several: a text
    # or token ids each (its job's `inputs`)
    inputs: list[str | list[int]] | None = None
    prompts_listed: bool = False  # a completions line's prompt sent as a list: each is named prompt[i]

    @property
    def kind(self) -> str:
        """The kind of its job (core/protocol/job_kinds.py)."""
        return EMBEDDING if self.endpoint == EMBEDDINGS else GENERATION

    def size(self) -> RequestSize:
        """The lengths the request rules judge, of a line with one text prompt or messages."""
        prompt = self.prompt if isinstance(self.prompt, str) else None  # token ids: counted exactly anyway
        template_bytes = ChatOptions.from_json(self.chat).template_bytes()
        return RequestSize(prompt, self.messages, self.params.get("max_tokens"),
                           self.params.get("min_tokens", 0), template_bytes)

    def sizes(self) -> list[RequestSize]:
        """The lengths the request rules judge: each prompt's of a completions line with token ids or several
        prompts (a sequence each in the engine), else the line's one."""
        if self.kind == EMBEDDING or self.inputs is None:
            return [self.size()]
        prompts = Prompts(list(self.inputs), self.prompts_listed)
        return prompt_sizes(prompts, self.params.get("max_tokens"), self.params.get("min_tokens", 0))


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
    task: ModelTask | None = None  # what the model serves (core/protocol/model_task.py); None: not judged
    embedding: EmbeddingLimits | None = None  # an embeddings line's inputs are held to; None: not judged
    # The tokens of an embeddings line's text input as the model reads it (special tokens included).
    count_input: Callable[[str], int] | None = None
    adapters: frozenset[str] = frozenset()  # the LoRA adapters of the model a line may name as `model`
    vocab_size: int | None = None  # the token ids a completions line's prompt may hold; None: not judged

    def request_limits(self) -> RequestLimits:
        return RequestLimits(self.queue, self.max_prompt_tokens, self.max_output_tokens, self.max_model_len,
                             self.vocab_size)


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
        request = _request(number, custom_id, line, chosen)
        tokens = (_counted_inputs if request.kind == EMBEDDING else _counted)(request, chosen)
        params = request.params
        if request.model in chosen.adapters:  # run by the base model's workers, with the adapter
            params = with_lora(params, request.model)
        _check_engine_params(request.kind, params)
        return replace(request, params=params, prompt_tokens=tokens, lane=chosen.lane)
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
    _check_task(endpoint, limits)
    try:
        if endpoint == EMBEDDINGS:
            return _validated_embedding(number, custom_id, body, limits.served, limits.priorities)
        if endpoint == MESSAGES:
            return _validated_message(number, custom_id, body, limits.served, limits.priorities)
        request = parse_body(endpoint, body)
        return _validated(number, custom_id, endpoint, request, limits.served, limits.priorities)
    except Refusal as refusal:
        raise LineRejected(_line_code(refusal), refusal.message) from None


def _endpoint(url: object, body: dict[str, Any], batch_endpoint: str | None) -> str:
    if url is not None and url not in ENDPOINTS:
        raise LineRejected("invalid_url", f"url must be one of {', '.join(ENDPOINTS)}, got {url!r}")
    if url is not None and batch_endpoint is not None and url != batch_endpoint:
        raise LineRejected("invalid_url", f"url {url!r} differs from the batch endpoint {batch_endpoint!r}")
    endpoint = str(url or batch_endpoint or _endpoint_of_body(body))
    if endpoint == MESSAGES:  # its body is judged by the Messages rules, `messages` included
        if batch_endpoint != MESSAGES:
            raise LineRejected("invalid_url", f"url {MESSAGES!r} is read in a Message Batch only (POST "
                               f"{MESSAGES}/batches)")
        return endpoint
    if endpoint == EMBEDDINGS:
        if "input" not in body:
            raise LineRejected("invalid_body", f"{EMBEDDINGS} needs input in the body")
        return endpoint
    has_messages, has_prompt = "messages" in body, "prompt" in body
    if has_messages == has_prompt:
        raise LineRejected("invalid_body", "body must hold exactly one of messages or prompt")
    if (endpoint == CHAT) != has_messages:
        wanted = "messages" if endpoint == CHAT else "prompt"
        raise LineRejected("invalid_body", f"{endpoint} needs {wanted} in the body")
    return endpoint


def _endpoint_of_body(body: dict[str, Any]) -> str:
    """A line without a url, in a batch without an endpoint: `input` alone embeds, `messages` chats."""
    if "input" in body and "messages" not in body and "prompt" not in body:
        return EMBEDDINGS
    return CHAT if "messages" in body else COMPLETIONS


def _check_task(endpoint: str, limits: LineLimits) -> None:
    """An embeddings line to a model that generates text, or a generation line to one that embeds."""
    if limits.task is None:
        return
    model_id = limits.served.models[0] if limits.served.models else "default"
    _reject(task_problem(model_id, limits.task, "embed" if endpoint == EMBEDDINGS else "generate"))


def _validated_message(number: int, custom_id: str, body: dict[str, Any], served: Served,
                       priorities: PriorityRange) -> BatchRequest:
    """A Messages body read by Anthropic's rules into the chat request it asks for (as POST /v1/messages
    reads it), then judged as a chat line; a refusal names the field as the Messages body wrote it."""
    message = parse_message_body(body)
    request = message.chat_request()  # its refusals already name the Messages body's fields
    try:
        return _validated(number, custom_id, MESSAGES, request, served, priorities)
    except Refusal as refusal:
        raise message.anthropic_refusal(refusal) from None


def _validated(number: int, custom_id: str, endpoint: str, request: OpenAIRequest, served: Served,
               priorities: PriorityRange) -> BatchRequest:
    """The synchronous route's rules (core/protocol/openai_request.py), then what only a batch adds."""
    check_request(request, served)
    if request.stream:
        raise Refusal("invalid", "stream", "must be false in a batch")
    _check_deadline_miss(request.on_deadline_miss)
    options, prompts = ChatOptions(), None
    if isinstance(request, ChatCompletionCreate):
        messages = request.chat_messages(served.roles)
        options = request.chat_options(served.tool_parser)  # judged by check_request
    else:
        messages, prompts = None, request.prompts()
    priority = _priority(priorities, request.service_tier, request.priority)
    return BatchRequest(line=number, custom_id=custom_id, endpoint=endpoint, messages=messages,
                        prompt=prompts.stored_prompt() if prompts is not None else None,
                        params=chat_job_params(_job_params(request), options), model=request.model,
                        chat=options.to_json(), shown=request.prompt_view().to_json(), priority=priority,
                        deadline_s=request.deadline_s, service_tier=request.service_tier,
                        inputs=prompts.stored_inputs() if prompts is not None else None,
                        prompts_listed=prompts is not None and prompts.listed)


def _validated_embedding(number: int, custom_id: str, body: dict[str, Any], served: Served,
                         priorities: PriorityRange) -> BatchRequest:
    """POST /v1/embeddings' rules (core/protocol/embedding_request.py), then what only a batch adds."""
    request: EmbeddingCreate = parse_embedding_body(body)
    check_model(request.model, served)
    _check_deadline_miss(request.on_deadline_miss)
    priority = _priority(priorities, request.service_tier, request.priority)
    return BatchRequest(line=number, custom_id=custom_id, endpoint=EMBEDDINGS, messages=None, prompt=None,
                        params=request.job_params(), model=request.model, priority=priority,
                        deadline_s=request.deadline_s, service_tier=request.service_tier,
                        inputs=request.inputs())


def _check_deadline_miss(on_deadline_miss: str | None) -> None:
    if on_deadline_miss == "reject":
        raise Refusal("unsupported", "on_deadline_miss", "on_deadline_miss: reject is answered at submit "
                      "(the jobs API, the OpenAI routes); a batch line runs within its batch's completion "
                      "window, late or not")


def _priority(priorities: PriorityRange, service_tier: ServiceTier | None, priority: int | None) -> int:
    try:
        return priorities.job_priority(service_tier, priority)
    except PriorityNotPermitted as exc:
        raise LineRejected("priority_not_permitted", str(exc)) from None


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
    return params  # in their stored form once chat_options' job_params has added its own (JobParams.written)


def _check_engine_params(kind: str, params: dict[str, Any]) -> None:
    """Last, the engine's own rules over the params the job will run with."""
    problem = _engine_refusal(kind, json.dumps(params, sort_keys=True, separators=(",", ":")))
    if problem is not None:
        raise LineRejected("invalid_parameter", problem)


@functools.lru_cache(maxsize=ENGINE_CHECKS_KEPT)
def _engine_refusal(kind: str, params_json: str) -> str | None:
    """What the engine refuses in these stored params (as canonical JSON: the key of a pure function's
    results, since the lines of a batch mostly share their params), or None."""
    params = json.loads(params_json)
    try:
        if kind == EMBEDDING:
            pooling_params_from_json(params)
        else:
            sampling_params_from_json(params)
    except ValueError as error:
        return str(error)
    return None


def _line_code(refusal: Refusal) -> str:
    """The batch error code of a refusal the synchronous route answers with 400 (404: model_not_found)."""
    if refusal.kind == "model_not_found":
        return "model_not_found"
    root = (refusal.param or "").split("[")[0].split(".")[0]
    return "invalid_body" if refusal.param is None or root in _BODY_PARAMS else "invalid_parameter"


def _counted(request: BatchRequest, limits: LineLimits) -> int:
    """The request rules every door shares (core/protocol/request_limits.py), with each prompt's tokens
    counted between the two steps; their sum (the request's own count when no tokenizer counts them)."""
    sizes, rules = request.sizes(), limits.request_limits()
    for size in sizes:
        _reject(size_problem(size, rules))
    if limits.count_tokens is None:
        return request.prompt_tokens
    total = 0
    for size in sizes:
        tokens = _prompt_tokens(request, size, limits.count_tokens)
        _reject(tokens_problem(size, tokens, rules))
        total += tokens
    return total


def _prompt_tokens(request: BatchRequest, size: RequestSize, count: Callable[[BatchRequest], int]) -> int:
    """One prompt's tokens: token ids as sent; else what `count` makes of the line (its messages or its text),
    one of several prompts counted as a line of its own."""
    if size.token_ids is not None:
        return len(size.token_ids)
    one = replace(request, prompt=size.prompt, inputs=None) if request.inputs is not None else request
    try:
        return count(one)
    except ValueError as error:  # e.g. a chat template that rejects the messages
        raise _rejected(tokenizer_problem(size, error)) from None


def _counted_inputs(request: BatchRequest, limits: LineLimits) -> int:
    """An embeddings line's inputs judged as POST /v1/embeddings judges them
    (core/protocol/embedding_rules.py): before tokenizing, then each text input's tokens; the tokens its job
    will embed (the request's own count when not judged)."""
    assert request.inputs is not None
    rules = limits.embedding
    if rules is None:
        return request.prompt_tokens
    params = JobParams.from_stored(request.params)
    truncate, dimensions = params.truncate, params.dimensions
    _reject(inputs_problem(request.inputs, dimensions, truncate, rules))
    if limits.count_input is None:
        return request.prompt_tokens
    lengths = input_lengths(request.inputs, limits.count_input)
    _reject(lengths_problem(lengths, truncate, rules))
    return embedded_tokens(lengths, truncate, rules)


def _reject(problem: FieldProblem | None) -> None:
    if problem is not None:
        raise _rejected(problem)


def _rejected(problem: FieldProblem) -> LineRejected:
    return LineRejected(problem.line_code, problem.line_message)
