"""Job schemas: JobCreate and EmbeddingJobCreate (requests, one per kind), JobPublic (response), JobList (a
page)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AnyHttpUrl,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from conveyor.api.schemas.fields import (
    STORABLE,
    ChatRole,
    ChoiceCount,
    DeadlineSeconds,
    Logprobs,
    MinP,
    MinTokens,
    NonEmptyText,
    OnDeadlineMiss,
    OpenAIPenalty,
    OutputTokens,
    Priority,
    RepetitionPenalty,
    Seed,
    Stop,
    StopTokenIds,
    StoredJsonObject,
    StrictFlag,
    Temperature,
    TopK,
    TopP,
)
from conveyor.api.schemas.scheduling import ScheduleFields
from conveyor.core.protocol.completion_prompts import PromptField, Prompts, choices_problem
from conveyor.core.protocol.embedding_request import EmbeddingFields
from conveyor.core.protocol.job_kinds import EMBEDDING, GENERATION
from conveyor.core.protocol.job_params import JobParams
from conveyor.core.protocol.openai_request import CHAT_FIELDS, ChatFields
from conveyor.core.protocol.request_rules import MAX_TIMEOUT_S, MAX_TTL_S, json_problem, output_problem
from conveyor.core.protocol.service_tiers import ServiceTier
from conveyor.core.protocol.structured_rules import (
    MAX_CHOICES,
    structured_from_response_format,
    structured_problem,
)
from conveyor.core.protocol.tools import ToolCallIn, history_problem
from conveyor.core.views.public import JobPublic
from conveyor.core.webhooks.events import validate_filter
from conveyor.core.webhooks.ssrf import url_problem

MAX_RETRIES = 10
# Stored only when they differ from their defaults: a job without them keeps the params shape it always had.
STORED_WHEN_SET = {"n": 1, "prompt_logprobs": None, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                   "skip_special_tokens": True, "include_stop_str_in_output": False, "speculate": True}


def exactly_one_of(first: str, second: str) -> dict[str, Any]:
    """The JSON schema of "exactly one of two nullable fields is set (non-null)", which the model's own
    validation enforces: each branch requires its field with a non-null value."""
    return {"oneOf": [{"required": [name], "properties": {name: {"not": {"type": "null"}}}}
                      for name in (first, second)]}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: ChatRole = Field(examples=["user"], description="passed to the chat template as given")
    content: Annotated[str, STORABLE] | None = Field(description="null only beside tool_calls")
    tool_calls: list[ToolCallIn] | None = Field(None, description="calls an assistant message made")
    tool_call_id: Annotated[str, STORABLE] | None = Field(None, description="the call a tool message answers")

    def stored(self) -> dict[str, Any]:
        """As the job stores it: role and content, and the tool fields only when sent."""
        extra = self.model_dump(mode="json", include={"tool_calls", "tool_call_id"}, exclude_none=True)
        return {"role": self.role, "content": self.content, **extra}


def _url_as_sent(value: object) -> object:
    """pydantic's URL type drops tabs and newlines and percent-encodes spaces: such a URL is refused as
    sent, naming what is wrong (core/webhooks/ssrf.py: url_problem)."""
    if isinstance(value, str):
        problem = url_problem(value)
        if problem is not None:
            raise PydanticCustomError("url_parsing", problem)
    return value


def event_filter(value: list[str]) -> list[str]:
    """A subscription's (or a target's) `events`: exact types, `<group>.*` or `*`, at least one."""
    if not value:
        raise PydanticCustomError("empty_event_filter", "must name at least one event type, "
                                  "'<group>.*' or '*' (omit it for every event)")
    try:
        return validate_filter(value)
    except ValueError as exc:
        raise PydanticCustomError("invalid_event_filter", str(exc)) from None


WebhookUrl = Annotated[AnyHttpUrl, BeforeValidator(_url_as_sent)]


class WebhookSpec(BaseModel):
    """The target `url`; any other fields are stored with it (as JSON, so they must be storable JSON)."""

    model_config = ConfigDict(extra="allow")

    url: WebhookUrl
    events: list[str] | None = Field(None, description="an event filter as a subscription's; stored")

    @field_validator("events")
    @classmethod
    def _known_events(cls, value: list[str] | None) -> list[str] | None:
        return None if value is None else event_filter(value)

    @model_validator(mode="after")
    def _storable_extras(self) -> WebhookSpec:
        problem = json_problem(self.model_extra or {})
        if problem is not None:
            raise PydanticCustomError("invalid_json_value", problem)
        return self


WebhookTarget = WebhookUrl | WebhookSpec


def webhook_json(webhook: AnyHttpUrl | WebhookSpec | None) -> dict[str, Any] | None:
    """A job's or batch's `webhook` as stored: {"url", ...the object's other fields as sent}."""
    if webhook is None:
        return None
    if isinstance(webhook, WebhookSpec):
        return webhook.model_dump(mode="json", exclude_unset=True)
    return {"url": str(webhook)}


class JobPlacement(ScheduleFields):
    """What a job of either kind says of where it runs and how it is kept: its model and queue, its urgency,
    when it may start (ScheduleFields), its lifetime and retries, its metadata and webhook."""

    model: str | None = Field(None, min_length=1, description="the served model to run it "
                              "(`GET /v1/models`); unset = the default model")
    queue: str = Field("interactive", description="interactive or documents")
    metadata: StoredJsonObject | None = Field(None, description="small JSON object returned as given")
    priority: Priority | None = Field(None, description="lower is served first; default 0, or the "
                                      "service_tier's")
    service_tier: ServiceTier | None = Field(
        None, description="OpenAI's: priority (ahead of the default tier: priority -1), flex (spare "
        "capacity: priority 1 and no default deadline), auto or default")
    deadline_s: DeadlineSeconds | None = Field(
        None, description="seconds after submission by which the result is wanted (default: the queue's "
        "default_deadline_s): a soft target the schedulers order by; a late job still runs")
    on_deadline_miss: OnDeadlineMiss = "accept"
    ttl: float | None = Field(None, strict=True, gt=0, le=MAX_TTL_S, allow_inf_nan=False,
                              description="seconds; the job expires if not started in time")
    timeout: float | None = Field(None, strict=True, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False,
                                  description="seconds; fails with code `timeout` when over")
    max_retries: int | None = Field(
        None, strict=True, ge=0, le=MAX_RETRIES,
        description="automatic retries after failures that are not the request's own (worker lost, engine "
        "out of memory, model not loadable yet), each after an exponential backoff with jitter; default: "
        "the queue's max_retries")
    webhook: WebhookTarget | None = Field(None, description="URL or object with `url`; stored")

    def webhook_json(self) -> dict[str, Any] | None:
        return webhook_json(self.webhook)


class JobCreate(ChatFields, JobPlacement):
    """A generation job: exactly one of `prompt` (text, token ids, or several of either, as /v1/completions
    takes it: core/protocol/completion_prompts.py) or `messages`, sampling parameters named as in the engine;
    chat jobs also take the tool and template fields (ChatFields)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=exactly_one_of("prompt", "messages"))

    kind: Literal["generation"] = Field(GENERATION, description="a generation job (the default)")
    prompt: PromptField | None = Field(
        None, description="raw text prompt; or token ids (read as sent: no BOS added), or a list of prompts "
        "(each a text or token ids), whose n choices each are result.choices, `index` prompt * n + choice")
    messages: list[ChatMessage] | None = Field(
        None, min_length=1, description="chat messages, rendered with the model's chat template"
    )
    n: ChoiceCount = Field(1, description="choices from each prompt (result.choices); a prompt is "
                           "computed once, and each choice may write up to max_tokens")
    max_tokens: OutputTokens = 16
    min_tokens: MinTokens = 0
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    min_p: MinP = 0.0
    seed: Seed | None = None
    stop: Stop | None = None
    stop_token_ids: StopTokenIds = Field(default_factory=list)
    ignore_eos: StrictFlag = False
    skip_special_tokens: StrictFlag = Field(True, description="leave special tokens out of the text (vLLM's)")
    include_stop_str_in_output: StrictFlag = Field(
        False, description="keep a matched stop string at the end of the text (vLLM's)")
    speculate: StrictFlag = Field(
        True, description="let the model's speculative decoding draft tokens for this job, where its model "
        "speculates (the `speculative` setting; the output is the same either way); false: none")
    repetition_penalty: RepetitionPenalty = 1.0
    presence_penalty: OpenAIPenalty = Field(0.0, description="as OpenAI: minus this for a generated token")
    frequency_penalty: OpenAIPenalty = Field(
        0.0, description="as OpenAI: minus this times each generated token's count")
    logprobs: Logprobs | None = Field(
        None, description="return this many alternatives per generated token (result.logprobs)",
    )
    prompt_logprobs: Logprobs | None = Field(
        None, description="return each prompt token's logprob and this many alternatives "
        "(result.prompt_logprobs, the first null); the prompt is then computed, not taken from the cache")
    # Structured outputs: at most one of these.
    response_format: dict[str, Any] | None = Field(
        None, description='as OpenAI: {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}, '
                          '{"type": "json_object"} or {"type": "text"}',
    )
    regex: Annotated[str, Field(min_length=1)] | None = Field(None, description="output matches this regex")
    choice: Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_CHOICES)] | None = Field(
        None, description="output is exactly one of these strings",
    )

    @model_validator(mode="after")
    def _output_fields(self) -> JobCreate:
        prompts = self.prompts()
        problem = output_problem(self.max_tokens, self.n, self.prompt_logprobs)
        if problem is None and prompts is not None:
            problem = choices_problem(len(prompts.items), self.n)
        if problem is not None:
            raise PydanticCustomError("invalid_output", "{field}: {reason}",
                                      {"field": problem[0], "reason": problem[1]})
        return self

    @model_validator(mode="after")
    def _chat_fields(self) -> JobCreate:
        problem = self._chat_problem()
        if problem is not None:
            raise PydanticCustomError("invalid_chat", "{field}: {reason}",
                                      {"field": problem[0], "reason": problem[1]})
        return self

    def _chat_problem(self) -> tuple[str, str] | None:
        """(field, reason) for chat fields without messages, a history the template cannot be given, tool
        or template fields that cannot run, or a constrained tool call beside a structured output."""
        sent = [name for name in CHAT_FIELDS if getattr(self, name) is not None]
        if sent and self.messages is None:
            return sent[0], "only with messages"
        problem = history_problem(self.stored_messages() or [])
        if problem is not None:
            return problem
        try:
            options = self.chat_options("hermes")  # the parser changes nothing judged here
        except ValueError as exc:
            field, _, reason = str(exc).partition(": ")
            return field, reason
        if options.constrained and self.structured() is not None:
            return "tool_choice", ("required or a named function constrains the output to the call: send no "
                                   "response_format, regex or choice with it")
        return None

    def prompts(self) -> Prompts | None:
        """Its prompts, each a text or token ids (None: a chat job)."""
        return Prompts.of(self.prompt) if self.prompt is not None else None

    def choice_count(self) -> int:
        """Its choices in all: n for each prompt."""
        prompts = self.prompts()
        return self.n * (len(prompts.items) if prompts is not None else 1)

    def stored_messages(self) -> list[dict[str, Any]] | None:
        return [message.stored() for message in self.messages] if self.messages is not None else None

    @field_validator("response_format")
    @classmethod
    def _known_response_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        try:
            structured = structured_from_response_format(value)
        except ValueError as exc:
            raise PydanticCustomError("invalid_response_format", str(exc)) from None
        problem = structured_problem(structured) if structured is not None else None
        if problem is not None:
            raise PydanticCustomError("invalid_response_format", problem)
        return value

    @field_validator("regex", "choice")
    @classmethod
    def _one_structured_output(cls, value: object, info: ValidationInfo) -> object:
        earlier = [name for name in ("response_format", "regex") if info.data.get(name) is not None]
        if value is not None and earlier and earlier != [info.field_name]:
            raise ValueError(f"send at most one of response_format, regex, choice; {earlier[0]} is set too")
        return value

    def _structured_sources(self) -> dict[str, dict[str, Any] | None]:
        fmt = structured_from_response_format(self.response_format) if self.response_format else None
        return {"response_format": fmt, "regex": {"regex": self.regex} if self.regex else None,
                "choice": {"choice": self.choice} if self.choice else None}

    def structured(self) -> dict[str, Any] | None:
        """The engine's structured-output form, stored in the job's params, or None."""
        return next((v for v in self._structured_sources().values() if v is not None), None)

    def sampling_params(self) -> dict[str, Any]:
        """The job's stored params before its chat options and its adapter: the fields it shares with
        JobParams (the engine's names), the newer ones only when set, and its structured output."""
        shared = set(JobParams.model_fields) & set(JobCreate.model_fields)
        params = self.model_dump(include=shared, mode="json")
        for name, default in STORED_WHEN_SET.items():
            if params[name] == default:
                del params[name]
        if isinstance(params["stop"], str):
            params["stop"] = [params["stop"]]
        params["stop"] = params["stop"] or []
        structured = self.structured()
        if structured is not None:
            params["structured"] = structured
        return JobParams.written(params)


class EmbeddingJobCreate(EmbeddingFields, JobPlacement):
    """An embedding job: a vector per input, as POST /v1/embeddings computes them (`input`,
    `encoding_format`, `dimensions`, `truncate`: the same rules, core/protocol/embedding_request.py), queued
    and kept as any job; its result is OpenAI's embeddings response."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["embedding"] = Field(description="an embedding job")


JOB_BODY_TAGS = {GENERATION: "JobCreate", EMBEDDING: "EmbeddingJobCreate"}  # by kind


def _kind_tag(body: Any) -> str | None:
    """Which model a job body is validated with: `kind` embedding, or a generation job (also without
    `kind`); None for an unknown kind (refused naming the kinds)."""
    kind = body.get("kind", GENERATION) if isinstance(body, dict) else getattr(body, "kind", GENERATION)
    return JOB_BODY_TAGS.get(kind) if isinstance(kind, str) else None


# POST /v1/jobs: either kind. The tags are the models' names: field_errors leaves them out of a field's name.
JobSubmission = Annotated[
    Annotated[JobCreate, Tag("JobCreate")] | Annotated[EmbeddingJobCreate, Tag("EmbeddingJobCreate")],
    Discriminator(_kind_tag, custom_error_type="invalid_kind",
                  custom_error_message="kind: must be generation or embedding"),
]
AnyJobCreate = JobCreate | EmbeddingJobCreate


class JobList(BaseModel):
    data: list[JobPublic]
    next_cursor: str | None = Field(description="pass as `cursor` for the next page; null on the last page")
