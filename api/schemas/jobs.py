"""Job schemas: JobCreate (request), JobPublic (response), JobList (a page)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    AnyHttpUrl,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from api.schemas.fields import (
    STORABLE,
    ChatRole,
    MinP,
    MinTokens,
    NonEmptyText,
    OpenAIPenalty,
    RepetitionPenalty,
    Seed,
    Stop,
    StopTokenIds,
    StoredJsonObject,
    Temperature,
    TokenCount,
    TopK,
    TopP,
)
from core.request_rules import MAX_LOGPROBS, MAX_TIMEOUT_S, MAX_TTL_S, json_problem
from core.structured_rules import MAX_CHOICES, structured_from_response_format, structured_problem
from core.views import JobPublic

SAMPLING_FIELDS = (
    "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "ignore_eos", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs",
)
# Stored only when set: a job without them keeps the params shape it always had.
ZERO_DEFAULT_FIELDS = ("presence_penalty", "frequency_penalty")


def exactly_one_of(first: str, second: str) -> dict[str, Any]:
    """The JSON schema of "exactly one of two nullable fields is set (non-null)", which the model's own
    validation enforces: each branch requires its field with a non-null value."""
    return {"oneOf": [{"required": [name], "properties": {name: {"not": {"type": "null"}}}}
                      for name in (first, second)]}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: ChatRole = Field(examples=["user"], description="passed to the chat template as given")
    content: Annotated[str, STORABLE]


class WebhookSpec(BaseModel):
    """The target `url`; any other fields are stored with it (as JSON, so they must be storable JSON)."""

    model_config = ConfigDict(extra="allow")

    url: AnyHttpUrl

    @model_validator(mode="after")
    def _storable_extras(self) -> WebhookSpec:
        problem = json_problem(self.model_extra or {})
        if problem is not None:
            raise PydanticCustomError("invalid_json_value", problem)
        return self


class JobCreate(BaseModel):
    """A generation job: exactly one of `prompt` or `messages`, sampling parameters named as in the engine."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=exactly_one_of("prompt", "messages"))

    prompt: NonEmptyText | None = Field(None, description="raw text prompt")
    messages: list[ChatMessage] | None = Field(
        None, min_length=1, description="chat messages, rendered with the model's chat template"
    )
    queue: str = Field("interactive", description="interactive or documents")
    max_tokens: TokenCount = 16
    min_tokens: MinTokens = 0
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    min_p: MinP = 0.0
    seed: Seed | None = None
    stop: Stop | None = None
    stop_token_ids: StopTokenIds = Field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: RepetitionPenalty = 1.0
    presence_penalty: OpenAIPenalty = Field(0.0, description="as OpenAI: minus this for a generated token")
    frequency_penalty: OpenAIPenalty = Field(
        0.0, description="as OpenAI: minus this times each generated token's count")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS,
        description="return this many alternatives per generated token (result.logprobs)",
    )
    metadata: StoredJsonObject | None = Field(None, description="small JSON object returned as given")
    ttl: float | None = Field(None, gt=0, le=MAX_TTL_S, allow_inf_nan=False,
                              description="seconds; the job expires if not started in time")
    timeout: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False,
                                  description="seconds; fails with code `timeout` when over")
    webhook: AnyHttpUrl | WebhookSpec | None = Field(None, description="URL or object with `url`; stored")
    # Structured outputs: at most one of these.
    response_format: dict[str, Any] | None = Field(
        None, description='as OpenAI: {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}, '
                          '{"type": "json_object"} or {"type": "text"}',
    )
    regex: Annotated[str, Field(min_length=1)] | None = Field(None, description="output matches this regex")
    choice: Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_CHOICES)] | None = Field(
        None, description="output is exactly one of these strings",
    )

    @field_validator("response_format")
    @classmethod
    def _known_response_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            structured = structured_from_response_format(value)
            problem = structured_problem(structured) if structured is not None else None
            if problem is not None:
                raise ValueError(problem)
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
        params = self.model_dump(include=set(SAMPLING_FIELDS), mode="json")
        for name in ZERO_DEFAULT_FIELDS:
            if not params[name]:
                del params[name]
        if isinstance(params["stop"], str):
            params["stop"] = [params["stop"]]
        params["stop"] = params["stop"] or []
        structured = self.structured()
        if structured is not None:
            params["structured"] = structured
        return params

    def webhook_json(self) -> dict[str, Any] | None:
        if self.webhook is None:
            return None
        if isinstance(self.webhook, WebhookSpec):
            return self.webhook.model_dump(mode="json")
        return {"url": str(self.webhook)}


class JobList(BaseModel):
    data: list[JobPublic]
    next_cursor: str | None = Field(description="pass as `cursor` for the next page; null on the last page")
