"""Job schemas: JobCreate (request), JobPublic (response), JobList (a page)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, AnyHttpUrl, BaseModel, ConfigDict, Field

from core.views import JobPublic

SAMPLING_FIELDS = (
    "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "ignore_eos", "repetition_penalty", "logprobs",
)
NonEmptyStr = Annotated[str, Field(min_length=1)]


def _no_nul(text: str) -> str:
    # NOTE: PostgreSQL text cannot hold NUL; refuse it here rather than fail at insert with a 500.
    if "\x00" in text:
        raise ValueError("must not contain NUL (\\u0000) characters")
    return text


PromptText = Annotated[str, AfterValidator(_no_nul)]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: str = Field(min_length=1, max_length=32, examples=["user"])
    content: PromptText


class WebhookSpec(BaseModel):
    """Stored now; delivery comes with the webhooks feature."""

    model_config = ConfigDict(extra="allow")

    url: AnyHttpUrl


class JobCreate(BaseModel):
    """A generation job: exactly one of `prompt` or `messages`, sampling parameters named as in the engine."""

    model_config = ConfigDict(extra="forbid")

    prompt: PromptText | None = Field(None, min_length=1, description="raw text prompt")
    messages: list[ChatMessage] | None = Field(
        None, min_length=1, description="chat messages, rendered with the model's chat template"
    )
    queue: str = Field("interactive", description="interactive or documents")
    max_tokens: int = Field(16, ge=1)
    min_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="0 or -1 = off")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=16)] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=64)] = Field(
        default_factory=list
    )
    ignore_eos: bool = False
    repetition_penalty: float = Field(1.0, gt=0.0)
    logprobs: int | None = Field(
        None, ge=0, le=20, description="return this many alternatives per generated token (result.logprobs)"
    )
    metadata: dict[str, Any] | None = Field(None, description="small JSON object returned as given")
    ttl: float | None = Field(None, gt=0, description="seconds; the job expires if not started in time")
    timeout: float | None = Field(None, gt=0, description="seconds; fails with code `timeout` when over")
    webhook: AnyHttpUrl | WebhookSpec | None = Field(None, description="URL or object with `url`; stored")

    def sampling_params(self) -> dict[str, Any]:
        params = self.model_dump(include=set(SAMPLING_FIELDS), mode="json")
        if isinstance(params["stop"], str):
            params["stop"] = [params["stop"]]
        params["stop"] = params["stop"] or []
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
