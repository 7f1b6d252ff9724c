"""What to write to the store for an attempt that ended: a completion, a failure, or nothing (an abort that
the store already knows about: cancelled, handed back at shutdown, superseded)."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime, timezone

from core.store import jobs
from engine.outputs import RequestOutput
from engine.tokenizer import Tokenizer
from worker.attempt import ENGINE_ERROR, INVALID_REQUEST, TIMEOUT, Attempt
from worker.logprobs import job_logprobs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ended:
    """An attempt left the engine (or never entered it): its outcome to write, then the attempt to release."""

    attempt: Attempt
    future: Future[RequestOutput] | None = None  # resolved; None: `failure` says what happened
    failure: tuple[str, str] | None = None  # (code, message) of an attempt the engine refused


def outcome(ended: Ended, tokenizer: Tokenizer) -> jobs.Outcome | None:
    """What to write for an attempt that ended; None when there is nothing to write."""
    attempt = ended.attempt
    if ended.future is None:
        assert ended.failure is not None
        return failure(attempt, *ended.failure)
    try:
        out = ended.future.result()
    except ValueError as exc:  # the engine refused it after submit: a grammar that cannot be compiled
        return failure(attempt, INVALID_REQUEST, str(exc))
    except Exception as exc:
        return failure(attempt, ENGINE_ERROR, describe(exc))
    if out.finish_reason == "abort":
        return _abort_outcome(attempt, out)
    return _completion(attempt, out, tokenizer)


def _completion(attempt: Attempt, out: RequestOutput, tokenizer: Tokenizer) -> jobs.Outcome:
    try:
        logprobs = job_logprobs(out.token_ids, out.logprobs, attempt.logprobs, tokenizer)
    except Exception as exc:
        log.exception("job %s: could not build its logprobs", attempt.job_id)
        return failure(attempt, ENGINE_ERROR, f"could not store the result: {type(exc).__name__}")
    return jobs.Completion(
        attempt.job_id, attempt.attempt, result_text=storable(out.text),
        finish_reason=str(out.finish_reason), prompt_tokens=len(out.prompt_token_ids),
        completion_tokens=len(out.token_ids), preemptions=out.metrics.num_preemptions,
        first_token_at=to_datetime(out.metrics.first_token_time), logprobs=logprobs,
        cached_tokens=out.num_cached_tokens,
    )


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


def storable(text: str) -> str:
    """Postgres text cannot hold NUL characters, which a random-weight model happily writes."""
    return text.replace("\x00", "\ufffd")


def to_datetime(ts: float | None) -> datetime | None:
    return datetime.fromtimestamp(ts, tz=timezone.utc) if ts is not None else None
