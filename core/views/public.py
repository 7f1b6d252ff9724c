"""What clients see of a job and of a batch: the body of their `GET` and the `data` of their webhook events.

Both places must show the same thing, frozen at the time of an event, so the shapes live here, beside the
domain, and not in the HTTP layer (api/schemas names them as response models).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from conveyor.core.lanes import split_lane
from conveyor.core.lifecycle import BATCH_CANCELLED, BATCH_EXPIRED, BATCH_FAILED, COMPLETED, TERMINAL_STATUSES
from conveyor.core.model_adapters import job_model_id
from conveyor.core.protocol.chat_options import ChatOptions
from conveyor.core.protocol.job_kinds import GENERATION, JobKind
from conveyor.core.protocol.job_params import JobParams
from conveyor.core.store.jobs.records import JobRecord
from conveyor.core.store.outcome_counts import due_since
from conveyor.core.store.tables import Batch, Job
from conveyor.core.views.embedding_objects import EmbeddingList, embedding_list
from conveyor.core.views.tool_calls import choice_seed, read_output

JobStatus = Literal["scheduled", "queued", "running", "succeeded", "failed", "cancelled", "expired"]


class TokenLogprob(BaseModel):
    token_id: int
    text: str = Field(description="the token decoded on its own (special tokens included)")
    logprob: float


class GeneratedTokenLogprob(TokenLogprob):
    top_logprobs: list[TokenLogprob] = Field(description="the `logprobs` most likely tokens, best first")


class PromptTokenLogprob(TokenLogprob):
    logprob: float | None = Field(description="null for the first prompt token: nothing precedes it")  # type: ignore[assignment]
    top_logprobs: list[TokenLogprob] = Field(description="the `prompt_logprobs` most likely tokens there")


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="a JSON object's text")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChoiceFields(BaseModel):
    text: str = Field(description="the generated text, as the model wrote it (tool calls included)")
    finish_reason: str | None
    logprobs: list[GeneratedTokenLogprob] | None = Field(
        None, description="per generated token, when the job asked for `logprobs`; else null"
    )
    tool_calls: list[ToolCallOut] | None = Field(
        None, description="the calls read from the text when the job offered tools (tool_choice not none) "
        "and the text holds well-formed calls; else null")


class JobChoice(ChoiceFields):
    index: int

    @classmethod
    def of(cls, job: Job | JobRecord, index: int, text: str, finish_reason: str | None,
           logprobs: list[dict[str, Any]] | None) -> JobChoice:
        read = read_output(text, ChatOptions.from_json(job.chat), choice_seed(job.id, index))
        tokens = [GeneratedTokenLogprob.model_validate(e) for e in logprobs] if logprobs is not None else None
        calls = [ToolCallOut.model_validate(call.as_openai()) for call in read.tool_calls] or None
        return cls(index=index, text=text, finish_reason=finish_reason, logprobs=tokens, tool_calls=calls)


class JobResult(ChoiceFields):
    """The first choice's text, finish_reason, logprobs and tool calls; with n > 1 (or token-id or several
    prompts), every choice too."""

    choices: list[JobChoice] | None = Field(
        None, description="every choice, when the job asked for n > 1 or its prompt is token ids or several "
        "(choice c of prompt p at index p * n + c)")
    prompt_logprobs: list[PromptTokenLogprob] | None = Field(
        None, description="per prompt token, when the job asked for `prompt_logprobs`; else null")

    @classmethod
    def of(cls, job: Job | JobRecord) -> JobResult:
        assert job.result_text is not None
        first = JobChoice.of(job, 0, job.result_text, job.finish_reason, job.logprobs)
        choices = None
        if job.choices:
            choices = [JobChoice.of(job, c["index"], c["text"], c["finish_reason"], c.get("logprobs"))
                       for c in job.choices]
        prompt = None
        if job.prompt_logprobs is not None:
            prompt = [PromptTokenLogprob.model_validate(entry) for entry in job.prompt_logprobs]
        return cls(**first.model_dump(exclude={"index"}), choices=choices, prompt_logprobs=prompt)


class JobUsage(BaseModel):
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None = Field(
        None, description="prompt tokens whose KV the engine found in its prefix cache (not computed again)"
    )
    draft_tokens: int | None = Field(
        None, description="tokens speculative decoding drafted for it, every choice together (0: none, as "
        "when its model does not speculate or it asked `speculate: false`); null: not succeeded, or "
        "finished before this was counted")
    accepted_draft_tokens: int | None = Field(
        None, description="of draft_tokens, those the model accepted: each saved a step of its own")


class JobError(BaseModel):
    code: str
    message: str | None


class AttemptRecord(BaseModel):
    """How one run of the job ended."""

    attempt: int = Field(description="the job's `attempts` when it ended (0: it never started)")
    status: str = Field(description="failed, cancelled, expired, or succeeded for the last one")
    error: JobError | None
    started_at: datetime | None
    finished_at: datetime | None


class JobPublic(BaseModel):
    id: str
    status: JobStatus
    kind: JobKind = Field(description="generation (text from a prompt or messages) or embedding (a vector "
                          "per input)")
    model: str = Field(description="the served model that runs it")
    queue: str
    result: JobResult | EmbeddingList | None = Field(
        description="once succeeded: a generation job's text (and choices, logprobs, tool calls); an "
        "embedding job's vectors in OpenAI's embeddings shape")
    usage: JobUsage
    error: JobError | None
    created_at: datetime
    started_at: datetime | None
    first_token_at: datetime | None
    finished_at: datetime | None
    expires_at: datetime | None
    priority: int = Field(description="lower is served first")
    service_tier: str | None = Field(description="the OpenAI service tier it asked for; null: none")
    deadline_at: datetime | None = Field(description="when the result is wanted (a soft target); null: none")
    start_by: datetime | None = Field(
        description="the latest start that meets deadline_at at its workers' measured pace (its deadline "
        "less its predicted run time): the fleet starts the job with the least slack first; null: no "
        "deadline")
    predicted_finish_at: datetime | None = Field(
        description="when submit predicted it would finish, from its queue's recent rate, the work ahead "
        "(an upper bound) and its own run time; null: no prediction (no deadline, or nothing finished "
        "lately)")
    queue_time_s: float | None = Field(description="started_at - created_at (from run_at when later: a "
                                       "scheduled or retried job counts from when it was due)")
    time_to_first_token_s: float | None = Field(description="first_token_at - created_at (or run_at)")
    end_to_end_s: float | None = Field(description="finished_at - created_at (or run_at)")
    attempts: int
    preemptions: int
    metadata: dict[str, Any] | None
    run_at: datetime | None = Field(
        None, description="when the job was last due: asked with run_at or delay_s, its retry, or its next "
        "attempt after a retryable failure (status scheduled until then); null: queued at submission")
    retries: int = Field(0, description="automatic retries used (since submission or the last retry)")
    max_retries: int | None = Field(None, description="automatic retries allowed; null: the default")
    history: list[AttemptRecord] = Field(
        default_factory=list, description="every ended run, oldest first: the outcomes kept when the job "
        "was retried, then the current one once final")

    @classmethod
    def from_row(cls, job: Job | JobRecord) -> JobPublic:
        error = JobError(code=job.error_code, message=job.error_message) if job.error_code else None
        queue = split_lane(job.queue)[1]
        model_id = job_model_id(job.queue, job.params)
        since = due_since(job.created_at, job.run_at)
        return cls(
            id=job.id, status=job.status, kind=job.kind or GENERATION, model=model_id,  # type: ignore[arg-type]
            queue=queue, result=_result(job, model_id),
            usage=JobUsage(prompt_tokens=job.prompt_tokens, completion_tokens=job.completion_tokens,
                           cached_tokens=job.cached_tokens, draft_tokens=job.draft_tokens,
                           accepted_draft_tokens=job.accepted_draft_tokens),
            error=error, created_at=job.created_at, started_at=job.started_at,
            first_token_at=job.first_token_at, finished_at=job.finished_at, expires_at=job.expires_at,
            priority=job.priority, service_tier=job.service_tier, deadline_at=job.deadline_at,
            start_by=job.start_by, predicted_finish_at=job.predicted_finish_at,
            queue_time_s=_seconds(since, job.started_at),
            time_to_first_token_s=_seconds(since, job.first_token_at),
            end_to_end_s=_seconds(since, job.finished_at),
            attempts=job.attempts, preemptions=job.preemptions, metadata=job.meta, run_at=job.run_at,
            retries=job.retries or 0, max_retries=job.max_retries, history=_history(job),
        )


def _history(job: Job | JobRecord) -> list[AttemptRecord]:
    """The kept outcomes, then the current one when final; a job never retried shows only its own."""
    kept = [AttemptRecord.model_validate(entry) for entry in job.history or []]
    if job.status in TERMINAL_STATUSES:
        error = JobError(code=job.error_code, message=job.error_message) if job.error_code else None
        kept.append(AttemptRecord(attempt=job.attempts, status=job.status, error=error,
                                  started_at=job.started_at, finished_at=job.finished_at))
    return kept


def _result(job: Job | JobRecord, model_id: str) -> JobResult | EmbeddingList | None:
    if job.embeddings is not None:
        encoding_format = JobParams.from_stored(job.params).encoding_format  # read by the worker that ran it
        body = embedding_list(job.embeddings, encoding_format, model_id, job.prompt_tokens or 0)
        return EmbeddingList.model_validate(body)
    return JobResult.of(job) if job.result_text is not None else None


def batch_public(batch: Batch) -> dict[str, Any]:
    """The batch as `GET /v1/batches/{id}` shows it: OpenAI's Batch object plus Conveyor's fields."""
    counts = {"total": batch.total, "completed": batch.completed, "failed": batch.failed,
              "cancelled": batch.cancelled}
    errors = {"object": "list", "data": batch.errors} if batch.errors else None
    final = batch.finished_at
    return {
        "id": batch.id, "object": "batch", "endpoint": batch.endpoint, "errors": errors,
        "input_file_id": batch.input_file_id, "completion_window": batch.completion_window,
        "status": batch.status, "output_file_id": batch.output_file_id, "error_file_id": batch.error_file_id,
        "created_at": _unix(batch.created_at), "in_progress_at": _unix(batch.in_progress_at),
        "expires_at": _unix(batch.expires_at), "finalizing_at": _unix(batch.finalizing_at),
        "completed_at": _unix(final if batch.status == COMPLETED else None),
        "failed_at": _unix(final if batch.status == BATCH_FAILED else None),
        "expired_at": _unix(final if batch.status == BATCH_EXPIRED else None),
        "cancelling_at": _unix(batch.cancelling_at),
        "cancelled_at": _unix(final if batch.status == BATCH_CANCELLED else None),
        "request_counts": counts, "metadata": batch.meta,
        "usage": {"input_tokens": batch.prompt_tokens, "output_tokens": batch.completion_tokens,
                  "total_tokens": batch.prompt_tokens + batch.completion_tokens,
                  "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
        "input": batch.input_url if batch.input_file_id is None else None, "output": batch.output_url,
        "outputs": batch.outputs, "queue": batch.queue, "run_at": _unix(batch.run_at),
        "webhook": {"url": batch.webhook["url"]} if batch.webhook else None,
    }


def _unix(when: datetime | None) -> int | None:
    return None if when is None else int(when.timestamp())


def _seconds(start: datetime, end: datetime | None) -> float | None:
    return None if end is None else round((end - start).total_seconds(), 6)
