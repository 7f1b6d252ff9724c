"""OpenAI-compatible request bodies: ChatCompletionCreate and CompletionCreate (what the `openai` SDK sends),
plus the engine extras it passes through `extra_body` (top_k, min_p, min_tokens, repetition_penalty,
ignore_eos). Unknown fields are refused with 400 naming them, as OpenAI does."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.schemas.fields import (
    MAX_INT32,
    MinP,
    MinTokens,
    NonEmptyText,
    OpenAITemperature,
    RepetitionPenalty,
    Seed,
    StoredText,
    TokenCount,
    TopK,
    TopP,
)
from api.schemas.jobs import Stop
from core.request_rules import MAX_LOGPROBS

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
CHAT_ROLES = {"developer": "system"}  # OpenAI's newer name for the system role
COMPLETIONS_MAX_LOGPROBS = 5  # OpenAI's limit for /v1/completions
STREAMED_LOGPROBS = "logprobs are not supported with stream=true; send the request without streaming"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: StoredText


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: StoredText | list[TextPart]
    name: StoredText | None = Field(None, description="accepted and ignored")

    def plain(self) -> dict[str, str]:
        """{"role", "content"} for the chat template: text parts joined, `developer` as `system`."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": CHAT_ROLES.get(self.role, self.role), "content": text}


class OpenAISampling(BaseModel):
    """Fields shared by both endpoints; None means "not sent" (OpenAI's defaults apply)."""

    model_config = ConfigDict(extra="forbid")

    model: NonEmptyText  # echoed in a 404: it must be encodable text
    max_tokens: TokenCount | None = None
    temperature: OpenAITemperature | None = None
    top_p: TopP | None = None
    n: int | None = Field(None, ge=1, le=MAX_INT32, description="only 1")
    stop: Stop | None = None
    seed: Seed | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: FiniteFloat | None = Field(None, description="only 0")
    frequency_penalty: FiniteFloat | None = Field(None, description="only 0")
    logit_bias: dict[str, FiniteFloat] | None = Field(None, description="only empty")
    user: StoredText | None = Field(None, description="accepted and ignored")
    # Engine extras (the SDK's extra_body)
    top_k: TopK | None = None
    min_p: MinP | None = None
    min_tokens: MinTokens | None = None
    repetition_penalty: RepetitionPenalty | None = None
    ignore_eos: bool | None = None
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "json_schema", "json_schema": {"name", "schema"}}, json_object or text'
    )

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def unsupported(self) -> tuple[str, str] | None:
        """(param, reason) for a sent value Conveyor cannot honour, else None."""
        if self.n not in (None, 1):
            return "n", "only n=1 is supported"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                return name, f"{name} is not supported (use repetition_penalty)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed with stream=true"
        return None

    def engine_params(self) -> dict[str, Any]:
        """The sent sampling fields under the job's (engine's) names; unsent ones keep the job defaults."""
        names = ("temperature", "top_p", "stop", "seed", "top_k", "min_p", "min_tokens", "repetition_penalty",
                 "ignore_eos", "response_format")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


class ChatCompletionCreate(OpenAISampling):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs set to true"
        if self.logprobs and self.stream:
            return "logprobs", STREAMED_LOGPROBS
        return super().unsupported()

    def engine_params(self) -> dict[str, Any]:
        """`logprobs: true` + `top_logprobs: n` is the engine's `logprobs: n` (0 alternatives by default)."""
        params = super().engine_params()
        if self.logprobs:
            params["logprobs"] = self.top_logprobs or 0
        return params

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionCreate(OpenAISampling):
    prompt: (NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1, max_length=1)] | list[int]
             | list[list[int]])
    logprobs: int | None = Field(None, ge=0, le=COMPLETIONS_MAX_LOGPROBS)
    echo: bool | None = None
    suffix: StoredText | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_INT32)

    def unsupported(self) -> tuple[str, str] | None:
        if isinstance(self.prompt, list) and not all(isinstance(p, str) for p in self.prompt):
            return "prompt", "token-id prompts are not supported; send text"
        checks = (("logprobs", self.logprobs is not None and bool(self.stream), STREAMED_LOGPROBS),
                  ("echo", bool(self.echo), "echo is not supported"),
                  ("suffix", bool(self.suffix), "suffix is not supported"),
                  ("best_of", self.best_of not in (None, 1), "only best_of=1 is supported"))
        for param, bad, reason in checks:
            if bad:
                return param, reason
        return super().unsupported()

    def engine_params(self) -> dict[str, Any]:
        params = super().engine_params()
        if self.logprobs is not None:
            params["logprobs"] = self.logprobs
        return params

    def prompt_text(self) -> str:
        prompt = self.prompt if isinstance(self.prompt, str) else self.prompt[0]
        assert isinstance(prompt, str), "checked by unsupported()"
        return prompt


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "conveyor"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
