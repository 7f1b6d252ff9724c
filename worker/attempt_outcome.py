"""What to write to the store for an attempt that ended: a completion (text, or an embedding job's vectors),
a failure, or nothing (an abort that the store already knows about: cancelled, handed back at shutdown,
superseded)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from conveyor.core.retry_policy import OUT_OF_MEMORY
from conveyor.core.store import jobs
from conveyor.core.views.embedding_vectors import encode_vector
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.tokenizer import Tokenizer
from conveyor.worker.attempt import ENGINE_ERROR, INVALID_REQUEST, TIMEOUT, Attempt, EngineFuture
from conveyor.worker.logprobs import job_logprobs, job_prompt_logprobs
from conveyor.worker.storable_text import storable
from conveyor.worker.transient import is_transient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ended:
    """An attempt left the engine (or never entered it): its outcome to write, then the attempt to release."""

    attempt: Attempt
    future: EngineFuture | None = None  # resolved; None: `failure` says what happened
    failure: tuple[str, str] | None = None  # (code, message) of an attempt the engine refused


def outcome(ended: Ended, tokenizer: Tokenizer) -> jobs.Outcome | None:
    """What to write for an attempt that ended; None when there is nothing to write."""
    attempt = ended.attempt
    if ended.future is None:
        assert ended.failure is not None
        return failure(attempt, *ended.failure)
    try:
        result = ended.future.result()
    except ValueError as exc:  # the engine refused it after submit: a grammar that cannot be compiled
        return failure(attempt, INVALID_REQUEST, str(exc))
    except Exception as exc:  # out of memory again after its retry on this worker: the retry policy's
        return failure(attempt, OUT_OF_MEMORY if is_transient(exc) else ENGINE_ERROR, describe(exc))
    outputs = result if isinstance(result, list) else [result]
    aborted = next((out for out in outputs if out.finish_reason == "abort"), None)
    if aborted is not None:
        return _abort_outcome(attempt, aborted)
    if attempt.embeds:
        return _embeddings(attempt, outputs)
    return _completion(attempt, outputs, tokenizer)


def _embeddings(attempt: Attempt, outputs: list[RequestOutput]) -> jobs.Outcome:
    """An embedding job's vectors, one per input in order; its usage is the tokens embedded."""
    missing = next((index for index, out in enumerate(outputs) if out.embedding is None), None)
    if missing is not None:
        return failure(attempt, ENGINE_ERROR, f"input[{missing}]: the engine returned no embedding")
    return jobs.Completion(
        attempt.job_id, attempt.attempt, result_text=None, finish_reason="stop",
        prompt_tokens=sum(len(out.prompt_token_ids) for out in outputs), completion_tokens=0,
        preemptions=sum(out.metrics.num_preemptions for out in outputs), first_token_at=None,
        cached_tokens=sum(out.num_cached_tokens for out in outputs),
        embeddings=[encode_vector(out.embedding or []) for out in outputs],
    )


def _completion(attempt: Attempt, outputs: list[RequestOutput], tokenizer: Tokenizer) -> jobs.Outcome:
    """Choice 0 is the job's result; with several, every choice is kept too, and usage counts them all. A job
    whose prompts are token ids or several (`inputs`) keeps every choice, and each prompt as read in the first
    of its choices (choice c of prompt p is outputs[p * n + c]; only c = 0 scored its prompt)."""
    first = outputs[0]
    firsts = outputs[:: attempt.choices_per_prompt()]  # each prompt's first choice
    try:
        choices = [_choice(index, out, attempt, tokenizer) for index, out in enumerate(outputs)]
        if attempt.prompts is not None:
            for index in range(0, len(outputs), attempt.choices_per_prompt()):
                choices[index]["prompt"] = _prompt_read(outputs[index], attempt, tokenizer)
        prompt_logprobs = job_prompt_logprobs(first.prompt_token_ids, first.prompt_logprobs,
                                              attempt.prompt_logprobs, tokenizer)
    except Exception as exc:
        log.exception("job %s: could not build its logprobs", attempt.job_id)
        return failure(attempt, ENGINE_ERROR, f"could not store the result: {type(exc).__name__}")
    return jobs.Completion(
        attempt.job_id, attempt.attempt, result_text=choices[0]["text"],
        finish_reason=str(first.finish_reason),
        prompt_tokens=sum(len(out.prompt_token_ids) for out in firsts),
        completion_tokens=sum(len(out.token_ids) for out in outputs),
        preemptions=sum(out.metrics.num_preemptions for out in outputs),
        first_token_at=to_datetime(min(_first_token_times(outputs), default=None)),
        logprobs=choices[0]["logprobs"], cached_tokens=sum(out.num_cached_tokens for out in firsts),
        draft_tokens=sum(out.num_draft_tokens for out in outputs),
        accepted_draft_tokens=sum(out.num_accepted_tokens for out in outputs),
        choices=choices if len(choices) > 1 or attempt.prompts is not None else None,
        prompt_logprobs=prompt_logprobs,
    )


def _prompt_read(out: RequestOutput, attempt: Attempt, tokenizer: Tokenizer) -> dict[str, Any]:
    """A prompt as its first choice read it: its text (token ids decoded, special tokens included: what was
    sent) and, when the job scored prompts, its tokens' logprobs."""
    text = out.prompt
    if text is None:
        text = tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
    logprobs = job_prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs, attempt.prompt_logprobs,
                                   tokenizer)
    return {"text": storable(text), "logprobs": logprobs}


def _choice(index: int, out: RequestOutput, attempt: Attempt, tokenizer: Tokenizer) -> dict[str, Any]:
    """One choice as a job stores it (core/views/public.py JobChoice)."""
    logprobs = job_logprobs(out.token_ids, out.logprobs, attempt.logprobs, tokenizer)
    return {"index": index, "text": storable(out.text), "finish_reason": str(out.finish_reason),
            "completion_tokens": len(out.token_ids), "logprobs": logprobs}


def _first_token_times(outputs: list[RequestOutput]) -> list[float]:
    return [out.metrics.first_token_time for out in outputs if out.metrics.first_token_time is not None]


def _abort_outcome(attempt: Attempt, out: RequestOutput) -> jobs.Outcome | None:
    preemptions = out.metrics.num_preemptions
    if attempt.abort_reason == TIMEOUT:
        message = f"timeout: ran longer than {attempt.timeout_s} s"
        return failure(attempt, TIMEOUT, message, preemptions)
    if attempt.abort_reason is None:  # aborted by the engine itself
        return failure(attempt, ENGINE_ERROR, "aborted by the engine", preemptions)
    return None  # cancelled (already so in the store), handed back at shutdown, or superseded


def failure(attempt: Attempt, code: str, message: str, preemptions: int = 0) -> jobs.Failure:
    log.warning("job %s attempt %d failed: %s: %s", attempt.job_id, attempt.attempt, code, message)
    return jobs.Failure(attempt.job_id, attempt.attempt, code, storable(message), preemptions)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def to_datetime(ts: float | None) -> datetime | None:
    return datetime.fromtimestamp(ts, tz=timezone.utc) if ts is not None else None
