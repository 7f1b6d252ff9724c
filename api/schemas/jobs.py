"""Job schemas: JobCreate (request), JobPublic (response), JobList (a page)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, AnyHttpUrl, BaseModel, ConfigDict, Field

from api.store.models import Job

JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled", "expired"]
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


class TokenLogprob(BaseModel):
    token_id: int
    text: str = Field(description="the token decoded on its own (special tokens included)")
    logprob: float


class GeneratedTokenLogprob(TokenLogprob):
    top_logprobs: list[TokenLogprob] = Field(description="the `logprobs` most likely tokens, best first")


class JobResult(BaseModel):
    text: str
    finish_reason: str | None
    logprobs: list[GeneratedTokenLogprob] | None = Field(
        None, description="per generated token, when the job asked for `logprobs`; else null"
    )


class JobUsage(BaseModel):
    prompt_tokens: int | None
    completion_tokens: int | None


class JobError(BaseModel):
    code: str
    message: str | None


class JobPublic(BaseModel):
    id: str
    status: JobStatus
    queue: str
    result: JobResult | None
    usage: JobUsage
    error: JobError | None
    created_at: datetime
    started_at: datetime | None
    first_token_at: datetime | None
    finished_at: datetime | None
    expires_at: datetime | None
    queue_time_s: float | None = Field(description="started_at - created_at")
    time_to_first_token_s: float | None = Field(description="first_token_at - created_at")
    end_to_end_s: float | None = Field(description="finished_at - created_at")
    attempts: int
    preemptions: int
    metadata: dict[str, Any] | None

    @classmethod
    def from_row(cls, job: Job) -> JobPublic:
        result = None
        if job.result_text is not None:
            logprobs = None
            if job.logprobs is not None:
                logprobs = [GeneratedTokenLogprob.model_validate(entry) for entry in job.logprobs]
            result = JobResult(text=job.result_text, finish_reason=job.finish_reason, logprobs=logprobs)
        error = JobError(code=job.error_code, message=job.error_message) if job.error_code else None
        return cls(
            id=job.id, status=job.status, queue=job.queue, result=result,  # type: ignore[arg-type]
            usage=JobUsage(prompt_tokens=job.prompt_tokens, completion_tokens=job.completion_tokens),
            error=error, created_at=job.created_at, started_at=job.started_at,
            first_token_at=job.first_token_at, finished_at=job.finished_at, expires_at=job.expires_at,
            queue_time_s=_seconds(job.created_at, job.started_at),
            time_to_first_token_s=_seconds(job.created_at, job.first_token_at),
            end_to_end_s=_seconds(job.created_at, job.finished_at),
            attempts=job.attempts, preemptions=job.preemptions, metadata=job.meta,
        )


class JobList(BaseModel):
    data: list[JobPublic]
    next_cursor: str | None = Field(description="pass as `cursor` for the next page; null on the last page")


def _seconds(start: datetime, end: datetime | None) -> float | None:
    return None if end is None else round((end - start).total_seconds(), 6)
