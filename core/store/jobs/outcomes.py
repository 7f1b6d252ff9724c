"""running -> succeeded | failed: a worker's writes for one engine step (first tokens, outcomes) in one
transaction, each row behind its own condition; a retryable failure with retries left is rescheduled."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Update, and_, bindparam, func, null, select, update
from sqlalchemy.orm import Session

from conveyor.core.lifecycle import FAILED, RUNNING, SCHEDULED, SUCCEEDED
from conveyor.core.retry_policy import DEFAULT_MAX_RETRIES, RETRYABLE_CODES, Backoff
from conveyor.core.store.final_status_effects import record_finished
from conveyor.core.store.jobs.history import outcome_entry, with_entry
from conveyor.core.store.jobs.reads import get_many
from conveyor.core.store.jobs.transitions import conditional_update, lock_in_id_order, transition
from conveyor.core.store.tables import Job


@dataclass(frozen=True, order=True)
class FirstToken:
    job_id: str
    attempt: int
    at: datetime


@dataclass(frozen=True)
class Completion:
    job_id: str
    attempt: int
    result_text: str | None  # None for an embedding job: its result is `embeddings`
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    preemptions: int
    first_token_at: datetime | None
    logprobs: list[dict[str, Any]] | None = None
    cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache
    draft_tokens: int = 0  # tokens speculative decoding proposed, over every choice
    accepted_draft_tokens: int = 0  # of those, the ones the model accepted
    choices: list[dict[str, Any]] | None = None  # every choice of a job that asked for n > 1
    prompt_logprobs: list[dict[str, Any]] | None = None  # per prompt token, when the job asked for them
    # an embedding job's vectors, in order (core/views/embedding_vectors.py)
    embeddings: list[str] | None = None


@dataclass(frozen=True)
class Failure:
    job_id: str
    attempt: int
    code: str
    message: str
    preemptions: int = 0


Outcome = Completion | Failure


def record_step(session: Session, first_tokens: list[FirstToken], outcomes: list[Outcome], now: datetime,
                backoff: Backoff = Backoff()) -> list[str]:
    """Writes a step's first tokens and outcomes in ONE transaction and commits: one UPDATE statement per
    kind of write, run for all its rows at once (executemany; on PostgreSQL one round trip), rows in id
    order. Each row's write is still conditional on (id, status running, attempt), so a late or duplicate
    outcome changes nothing, and only the jobs whose outcome applied get their follow-on effects
    (`record_finished`), once per status for the whole group; a retryable failure with retries left is
    rescheduled after `backoff` instead. Returns the ids of the jobs this made final."""
    first_of = {(first.job_id, first.attempt): first.at for first in first_tokens}
    rescheduled = _reschedule_retryable(session, outcomes, now, backoff)
    outcomes = [_with_first_token(outcome, first_of) for outcome in outcomes
                if outcome.job_id not in rescheduled]
    written = {(outcome.job_id, outcome.attempt) for outcome in outcomes if isinstance(outcome, Completion)}
    firsts = sorted(first for first in first_tokens if (first.job_id, first.attempt) not in written)
    if firsts:  # a completion writes its own first token (the earlier of the two)
        session.connection().execute(_FIRST_TOKEN, [{"b_id": first.job_id, "b_attempt": first.attempt,
                                                    "b_at": first.at} for first in firsts])
    finished: dict[str, list[str]] = {}
    for (status, statement), rows in _outcome_writes(outcomes, now).items():
        made_final = {job_id for job_ids in finished.values() for job_id in job_ids}
        applied = _applied(session, statement, rows, status, now)
        finished.setdefault(status, []).extend(job_id for job_id in applied if job_id not in made_final)
    for status, job_ids in finished.items():
        record_finished(session, job_ids, status, now)
    session.commit()
    return [job_id for job_ids in finished.values() for job_id in job_ids]


def _reschedule_retryable(session: Session, outcomes: list[Outcome], now: datetime, backoff: Backoff,
                          ) -> set[str]:
    """running -> scheduled, after its backoff, for each retryable failure (core/retry_policy.py) whose job
    has retries left; the failed attempt goes into its history. Not committed (record_step's transaction).
    Returns the ids rescheduled: their failures are not written."""
    retryable = {(outcome.job_id, outcome.attempt): outcome for outcome in outcomes
                 if isinstance(outcome, Failure) and outcome.code in RETRYABLE_CODES}
    if not retryable:
        return set()
    locked = lock_in_id_order(session, Job.id.in_([job_id for job_id, _ in retryable]), Job.status == RUNNING)
    rescheduled: set[str] = set()
    for job in get_many(session, locked):
        failure = retryable.get((job.id, job.attempts))
        if failure is None or job.retries >= (job.max_retries if job.max_retries is not None
                                              else DEFAULT_MAX_RETRIES):
            continue
        entry = outcome_entry(job, status=FAILED, error_code=failure.code, error_message=failure.message,
                              finished_at=now)
        run_at = now + timedelta(seconds=backoff.delay_s(job.retries + 1))
        if conditional_update(session, job.id, (RUNNING,), Job.attempts == job.attempts, status=SCHEDULED,
                              run_at=run_at, retries=job.retries + 1, history=with_entry(job, entry),
                              worker_id=None, dispatched_at=None, started_at=None, first_token_at=None,
                              updated_at=now):
            rescheduled.add(job.id)
    return rescheduled


def _with_first_token(outcome: Outcome, first_of: dict[tuple[str, int], datetime]) -> Outcome:
    """A completion whose first token is reported in the same step, with the earlier of the two times."""
    at = first_of.get((outcome.job_id, outcome.attempt))
    if not isinstance(outcome, Completion) or at is None:
        return outcome
    earliest = at if outcome.first_token_at is None else min(at, outcome.first_token_at)
    return dataclasses.replace(outcome, first_token_at=earliest)


_JOBS = Job.__table__


_RUNNING_ATTEMPT = (_JOBS.c.id == bindparam("b_id"), _JOBS.c.status == RUNNING,
                    _JOBS.c.attempts == bindparam("b_attempt"))


_FIRST_TOKEN = update(_JOBS).where(*_RUNNING_ATTEMPT, _JOBS.c.first_token_at.is_(None)).values(
    first_token_at=bindparam("b_at", type_=_JOBS.c.first_token_at.type),
    updated_at=bindparam("b_at", type_=_JOBS.c.updated_at.type))


_COMPLETION_FIELDS = ("result_text", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
                      "draft_tokens", "accepted_draft_tokens")


_COMPLETION_JSON = ("logprobs", "choices", "prompt_logprobs", "embeddings")


_FAILURE_FIELDS = ("error_code", "error_message")


def _outcome_writes(outcomes: list[Outcome], now: datetime,
                    ) -> dict[tuple[str, Update], list[dict[str, Any]]]:
    """The outcomes' rows grouped by the statement that writes them, in id order within each group."""
    writes: dict[tuple[str, Update], list[dict[str, Any]]] = {}
    for outcome in sorted(outcomes, key=lambda outcome: outcome.job_id):
        common = {"b_id": outcome.job_id, "b_attempt": outcome.attempt, "b_preemptions": outcome.preemptions,
                  "b_now": now}
        if isinstance(outcome, Failure):
            key = (FAILED, _outcome_statement(FAILED, _FAILURE_FIELDS, ()))
            fields: tuple[str, ...] = _FAILURE_FIELDS
            values = {"error_code": outcome.code, "error_message": outcome.message}
        else:
            given = tuple(name for name in _COMPLETION_JSON if getattr(outcome, name) is not None)
            nulls = tuple(name for name in _COMPLETION_JSON if name not in given)
            fields = (*_COMPLETION_FIELDS, *given, "first_token_at")
            key = (SUCCEEDED, _outcome_statement(SUCCEEDED, fields, nulls))
            values = {name: getattr(outcome, name) for name in fields}
        writes.setdefault(key, []).append({**common, **{"b_" + name: values[name] for name in fields}})
    return writes


@functools.cache
def _outcome_statement(status: str, fields: tuple[str, ...], nulls: tuple[str, ...]) -> Update:
    """running -> status for one row per parameter set: `fields` from parameters named b_<column>, `nulls`
    set to SQL NULL; a first token already stored is kept, preemptions are added."""
    values: dict[str, Any] = {name: bindparam("b_" + name, type_=_JOBS.c[name].type) for name in fields}
    if "first_token_at" in values:
        values["first_token_at"] = func.coalesce(_JOBS.c.first_token_at, values["first_token_at"])
    return update(_JOBS).where(*_RUNNING_ATTEMPT).values(
        status=status, preemptions=_JOBS.c.preemptions + bindparam("b_preemptions"),
        finished_at=bindparam("b_now", type_=_JOBS.c.finished_at.type),
        updated_at=bindparam("b_now", type_=_JOBS.c.updated_at.type), **values,
        **{name: null() for name in sorted(nulls)})


def _applied(session: Session, statement: Update, rows: list[dict[str, Any]], status: str, now: datetime,
             ) -> list[str]:
    """Runs `statement` for every row; returns the ids of the rows it changed."""
    job_ids = [row["b_id"] for row in rows]
    if session.connection().execute(statement, rows).rowcount == len(rows):
        return job_ids
    # Some job moved on first (cancelled, or its attempt ended elsewhere). This transaction holds the rows it
    # wrote until its commit, so the ones it wrote are those with this status at exactly this time.
    query = select(_JOBS.c.id).where(_JOBS.c.id.in_(job_ids), _JOBS.c.status == status,
                                     _JOBS.c.finished_at == now)
    return list(session.connection().execute(query).scalars())


def record_first_token(session: Session, job_id: str, attempt: int, at: datetime) -> bool:
    return transition(
        session, job_id, (RUNNING,), and_(Job.attempts == attempt, Job.first_token_at.is_(None)),
        first_token_at=at, updated_at=at,
    )


def complete(
    session: Session,
    job_id: str,
    attempt: int,
    *,
    result_text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    preemptions: int,
    first_token_at: datetime | None,
    now: datetime,
    logprobs: list[dict[str, Any]] | None = None,
    cached_tokens: int = 0,
    draft_tokens: int = 0,
    accepted_draft_tokens: int = 0,
) -> bool:
    """running -> succeeded, only for the attempt that is running."""
    outcome = Completion(job_id, attempt, result_text, finish_reason, prompt_tokens, completion_tokens,
                         preemptions, first_token_at, logprobs, cached_tokens, draft_tokens,
                         accepted_draft_tokens)
    return bool(record_step(session, [], [outcome], now))


def fail(
    session: Session,
    job_id: str,
    attempt: int,
    *,
    code: str,
    message: str,
    now: datetime,
    preemptions: int = 0,
) -> bool:
    """running -> failed, only for the attempt that is running."""
    return bool(record_step(session, [], [Failure(job_id, attempt, code, message, preemptions)], now))
