"""Job rows and their state transitions.

Every status change is ONE conditional UPDATE (`WHERE id = :id AND status IN (...)`, plus the attempt
number where a worker reports), so a late or duplicate message can never complete a job twice or revive a
cancelled one. Each transition commits its own transaction and says whether it applied, except that a
worker's writes for one engine step (first tokens, outcomes) and its claims go in groups, one transaction
and one set of follow-on effects per group, each row still behind its own condition. Times are
timezone-aware UTC datetimes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Select,
    Update,
    and_,
    bindparam,
    delete,
    func,
    literal_column,
    null,
    or_,
    select,
    update,
)
from sqlalchemy.orm import Session

from conveyor.core.job_history import outcome_entry, with_entry
from conveyor.core.job_kinds import GENERATION
from conveyor.core.lanes import lane_of, queue_of
from conveyor.core.lifecycle import (
    CANCELLED,
    EXPIRED,
    FAILED,
    JOB_STATUSES,
    JOB_TRANSITIONS,
    OPEN_BATCH_STATUSES,
    QUEUED,
    RETRYABLE_STATUSES,
    RUNNING,
    SCHEDULED,
    SUCCEEDED,
    TERMINAL_STATUSES,
    WAITING_STATUSES,
)
from conveyor.core.retry_policy import DEFAULT_MAX_RETRIES, RETRYABLE_CODES, WORKER_LOST, Backoff
from conveyor.core.service_tiers import goodput_tier
from conveyor.core.store import outcome_counts, webhook_events, webhooks
from conveyor.core.store.final_status_effects import record_finished
from conveyor.core.store.paging import newest_first
from conveyor.core.store.tables import Batch, BatchLine, Job, JobTallyDelta
from conveyor.core.store.token_usage import DEFAULT_MAX_TOKENS

EXPIRE_BATCH = 500  # queued jobs past their ttl expired per statement (expire_overdue)

@dataclass(frozen=True)
class NewJob:
    """A job as any door submits it (the job API, the OpenAI routes, a batch line), judged by the request
    rules (core/request_limits.py) before it gets here."""

    tenant_id: str
    queue: str
    prompt: str | None
    messages: list[dict[str, Any]] | None
    params: dict[str, Any]
    meta: dict[str, Any] | None
    webhook: dict[str, Any] | None
    idempotency_key: str | None
    request_hash: str
    prompt_tokens: int
    ttl_s: float | None
    timeout_s: float | None
    batch_id: str | None = None  # the batch whose line this job answers; set by the batch runner only
    chat: dict[str, Any] | None = None  # core/chat_options.py's stored form
    priority: int = 0  # lower first
    deadline_s: float | None = None  # soft target, seconds after submission
    predicted_finish_at: datetime | None = None  # submit's prediction, when it made one
    start_by: datetime | None = None  # latest start meeting the deadline (finish_times.forecast)
    service_tier: str | None = None  # the OpenAI service tier asked for
    # An embedding job (core/job_kinds.py) has `inputs` (each a text or token ids) and neither prompt nor
    # messages; its params are core/embedding_request.py's job_params.
    kind: str = GENERATION
    inputs: list[str | list[int]] | None = None
    run_at: datetime | None = None  # due then (status scheduled until); None: queued at once
    max_retries: int | None = None  # automatic retries of retryable failures (core/retry_policy.py)


def new_job_id() -> str:
    return "job_" + uuid.uuid4().hex


def request_hash(request: object) -> str:
    """A request's fingerprint (sha256 of its canonical JSON): an Idempotency-Key replay must match it."""
    canonical = json.dumps(request, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def build(new: NewJob, now: datetime) -> Job:
    """The queued job row of `new`, in no session yet: the one constructor of every door's jobs (`add`
    inserts one; a batch chunk adds its rows in its own transaction)."""
    return Job(**_queued_row(new, now))


def add(session: Session, new: NewJob, now: datetime) -> Job:
    """Inserts a queued job and commits. Raises sqlalchemy IntegrityError on a duplicate idempotency key."""
    row = _queued_row(new, now)
    # A Core INSERT of the table: neither unit-of-work bookkeeping nor the ORM's bulk path for one new row.
    session.execute(_INSERT_JOB, [_by_column(row)])
    session.commit()
    return Job(**row)  # not attached to the session: the caller only reads it


def _by_column(row: dict[str, Any]) -> dict[str, Any]:
    """A row keyed by Job's attributes, keyed by its table's columns instead (`meta` is `metadata`)."""
    values = dict(row)
    values["metadata"] = values.pop("meta")
    return values


_INSERT_JOB = Job.__table__.insert()


def _queued_row(new: NewJob, now: datetime) -> dict[str, Any]:
    """Queued, or scheduled when `run_at` is ahead: its ttl and deadline then count from its due time."""
    scheduled = new.run_at is not None and new.run_at > now
    since = new.run_at if new.run_at is not None and scheduled else now
    expires_at = since + timedelta(seconds=new.ttl_s) if new.ttl_s is not None else None
    deadline_at = since + timedelta(seconds=new.deadline_s) if new.deadline_s is not None else None
    return dict(
        id=new_job_id(), tenant_id=new.tenant_id, queue=new.queue, status=SCHEDULED if scheduled else QUEUED,
        prompt=new.prompt, run_at=new.run_at if scheduled else None, max_retries=new.max_retries, retries=0,
        messages=new.messages, params=new.params, meta=new.meta, webhook=new.webhook,
        idempotency_key=new.idempotency_key, request_hash=new.request_hash, ttl_s=new.ttl_s,
        timeout_s=new.timeout_s, expires_at=expires_at, created_at=now, updated_at=now, attempts=0,
        preemptions=0, prompt_tokens=new.prompt_tokens, batch_id=new.batch_id, chat=new.chat,
        priority=new.priority, deadline_at=deadline_at, predicted_finish_at=new.predicted_finish_at,
        start_by=new.start_by if new.start_by is not None else deadline_at, service_tier=new.service_tier,
        kind=new.kind, inputs=new.inputs,
    )


def get(session: Session, job_id: str, tenant_id: str | None = None) -> Job | None:
    """The job, or None; with `tenant_id`, another tenant's job is None too."""
    query = select(Job).where(Job.id == job_id).execution_options(populate_existing=True)
    if tenant_id is not None:
        query = query.where(Job.tenant_id == tenant_id)
    return session.execute(query).scalar_one_or_none()


def get_many(session: Session, job_ids: list[str]) -> list[Job]:
    """The jobs of these ids that exist, in no particular order."""
    query = select(Job).where(Job.id.in_(job_ids)).execution_options(populate_existing=True)
    return list(session.execute(query).scalars())


def by_idempotency_key(session: Session, tenant_id: str, key: str) -> Job | None:
    query = select(Job).where(Job.tenant_id == tenant_id, Job.idempotency_key == key)
    return session.execute(query.execution_options(populate_existing=True)).scalar_one_or_none()


def page(
    session: Session,
    tenant_id: str | None,
    *,
    limit: int,
    status: str | None = None,
    lanes: list[str] | None = None,
    before: tuple[datetime, str] | None = None,
    batch_id: str | None = None,
    since: datetime | None = None,
    metadata: tuple[str, str] | None = None,
) -> list[Job]:
    """Newest first by (created_at, id); `before` is the last (created_at, id) of the previous page;
    `lanes`: only jobs of these (core/lanes.py); `since`: created after it; `metadata` (key, value): whose
    metadata has that key with that text value; `tenant_id` None: every tenant's (the console's admin view:
    no index serves it, so it reads the table's newest rows through a sort)."""
    query = select(Job)
    if tenant_id is not None:
        query = query.where(Job.tenant_id == tenant_id)
    if status is not None:
        query = query.where(Job.status == status)
    if lanes is not None:
        query = query.where(Job.queue.in_(lanes))
    if batch_id is not None:
        query = query.where(Job.batch_id == batch_id)
    if since is not None:
        query = query.where(Job.created_at > since)
    if metadata is not None:
        query = query.where(Job.meta[metadata[0]].as_string() == metadata[1])
    return list(session.execute(newest_first(query, Job, limit=limit, before=before)).scalars())


def status_is(status: str) -> ColumnElement[bool]:
    """`status = '<status>'` with the status written into the SQL, not bound: PostgreSQL may plan a bound
    parameter generically, and a generic plan cannot use the partial indexes (tables.PARTIAL_INDEXES), whose
    predicates name the status."""
    assert status in JOB_STATUSES, status
    return Job.status == literal_column(f"'{status}'")


def count_queued(session: Session, queue: str, tenant_id: str | None = None, *, up_to: int | None = None,
                 ) -> int:
    """The queue's queued jobs; with `tenant_id`, that tenant's only. With `up_to`, counted only up to it
    (an admission check asks whether a limit is reached: its cost is bounded by the limit, not the
    backlog)."""
    rows = select(literal_column("1")).where(Job.queue == queue, status_is(QUEUED))
    if tenant_id is not None:
        rows = rows.where(Job.tenant_id == tenant_id)
    if up_to is not None:
        rows = rows.limit(up_to)
    return int(session.execute(select(func.count()).select_from(rows.subquery())).scalar_one())


def succeeded_per_minute(session: Session, lane: str, now: datetime, minutes: int,
                         tenant_id: str | None = None) -> list[int]:
    """The lane's jobs that succeeded in each of the last `minutes` minutes, oldest first; with `tenant_id`,
    that tenant's only. One statement of `minutes` counts, each a range of ix_jobs_succeeded_finished."""
    def in_minute(ago: int) -> ColumnElement[int]:
        end = now - timedelta(minutes=ago)
        rows = select(func.count()).where(status_is(SUCCEEDED), Job.queue == lane, Job.finished_at <= end,
                                          Job.finished_at > end - timedelta(minutes=1))
        if tenant_id is not None:
            rows = rows.where(Job.tenant_id == tenant_id)
        return rows.scalar_subquery()

    counts = session.execute(select(*(in_minute(ago) for ago in range(minutes - 1, -1, -1)))).one()
    return [int(n) for n in counts]


def failures_since(session: Session, since: datetime, tenant_id: str | None = None,
                   ) -> list[tuple[str, str, int]]:
    """(lane, error code, jobs) of the jobs that failed or expired since `since`, the most first; with
    `tenant_id`, that tenant's only (ix_jobs_failed_finished: the failures of that time, not the table)."""
    failed = Job.status.in_((literal_column("'failed'"), literal_column("'expired'")))
    code = func.coalesce(Job.error_code, "unknown")
    query = (select(Job.queue, code, func.count()).where(failed, Job.finished_at >= since)
             .group_by(Job.queue, code).order_by(func.count().desc(), Job.queue, code))
    if tenant_id is not None:
        query = query.where(Job.tenant_id == tenant_id)
    return [(lane, str(error), int(n)) for lane, error, n in session.execute(query)]


DeadlineCounts = dict[str, dict[str, dict[str, int]]]  # queue -> goodput tier -> outcome -> jobs


def deadline_counts(session: Session, since: datetime, tenant_id: str | None = None) -> DeadlineCounts:
    """Per queue and goodput tier (core/service_tiers.py goodput_tier), the jobs with a deadline that ended
    since `since`, by outcome (on_time, late, missed: the metrics' rule, outcome_counts.deadline_outcome);
    with `tenant_id`, that tenant's only. Only tiers with such jobs appear."""
    outcome = outcome_counts.deadline_outcome_sql()
    query = (
        select(Job.queue, Job.service_tier, outcome, func.count())
        .where(Job.deadline_at.is_not(None), Job.finished_at >= since, Job.status.in_(TERMINAL_STATUSES))
        .group_by(Job.queue, Job.service_tier, outcome)
    )
    if tenant_id is not None:
        query = query.where(Job.tenant_id == tenant_id)
    counts: DeadlineCounts = {}
    for queue, tier, kind, n in session.execute(query):
        by_outcome = counts.setdefault(queue, {}).setdefault(goodput_tier(tier), {})
        by_outcome[kind] = by_outcome.get(kind, 0) + int(n)  # auto, default and none are one tier
    return counts


# --- transitions -------------------------------------------------------------------------------------


def claim(session: Session, job_id: str, worker_id: str, now: datetime) -> Job | None:
    """`claim_many` of one job: the claimed row, or None."""
    claimed = claim_many(session, [job_id], worker_id, now)
    return claimed[0] if claimed else None


def claim_many(session: Session, job_ids: list[str], worker_id: str, now: datetime) -> list[Job]:
    """queued -> running (attempts + 1, started_at = now) for every job of `job_ids` still queued, in one
    statement that returns the claimed rows (no read-back that a dropped connection could separate from the
    commit), in the order of `job_ids`. Jobs not queued are left out; those whose ttl has passed are expired
    in the same call."""
    if not job_ids:
        return []
    not_expired = or_(Job.expires_at.is_(None), Job.expires_at > now)
    claimable = lock_in_id_order(session, Job.id.in_(job_ids), Job.status == QUEUED, not_expired)
    claimed = {job.id: job for job in claim_ids(session, claimable, worker_id, now)}
    if claimed:
        webhook_events.enqueue_started_events(session, list(claimed.values()), now)
    session.commit()
    if len(claimed) < len(set(job_ids)):
        expire_overdue(session, now, [job_id for job_id in job_ids if job_id not in claimed])
    return [claimed[job_id] for job_id in dict.fromkeys(job_ids) if job_id in claimed]


def claim_ids(session: Session, job_ids: list[str], worker_id: str, now: datetime) -> list[Job]:
    """queued -> running (attempts + 1, started_at = now, held by worker_id) for those of `job_ids` still
    queued, not committed: a claim's one write (here and in core/store/fair_share.py, whose claim adds the
    `job.started` events of all it claimed, as claim_many does). Returns those rows."""
    if not job_ids:
        return []
    params = {"b_ids": job_ids, "b_worker_id": worker_id, "b_now": now}
    return list(session.execute(_CLAIM_IDS, params).scalars())


_CLAIM_IDS = (  # built once: the claim runs for every job
    update(Job)
    .where(Job.id.in_(bindparam("b_ids", expanding=True)), Job.status == QUEUED)
    .values(status=RUNNING, attempts=Job.attempts + 1, first_token_at=None,
            worker_id=bindparam("b_worker_id", type_=Job.worker_id.type),
            started_at=bindparam("b_now", type_=Job.started_at.type),
            updated_at=bindparam("b_now", type_=Job.updated_at.type))
    .returning(Job)
    .execution_options(synchronize_session=False, populate_existing=True)
)


# --- a worker's writes, grouped: one transaction per engine step -----------------------------------


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
    choices: list[dict[str, Any]] | None = None  # every choice of a job that asked for n > 1
    prompt_logprobs: list[dict[str, Any]] | None = None  # per prompt token, when the job asked for them
    embeddings: list[str] | None = None  # an embedding job's vectors (core/embedding_vectors.py), in order


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
        session.execute(_FIRST_TOKEN, [{"b_id": first.job_id, "b_attempt": first.attempt, "b_at": first.at}
                                       for first in firsts])
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
        if _update(session, job.id, (RUNNING,), Job.attempts == job.attempts, status=SCHEDULED, run_at=run_at,
                   retries=job.retries + 1, history=with_entry(job, entry), worker_id=None,
                   dispatched_at=None, started_at=None, first_token_at=None, updated_at=now):
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
_COMPLETION_FIELDS = ("result_text", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens")
# None is SQL NULL, not JSON null.
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
    if session.execute(statement, rows).rowcount == len(rows):  # type: ignore[attr-defined]
        return job_ids
    # Some job moved on first (cancelled, or its attempt ended elsewhere). This transaction holds the rows it
    # wrote until its commit, so the ones it wrote are those with this status at exactly this time.
    query = select(_JOBS.c.id).where(_JOBS.c.id.in_(job_ids), _JOBS.c.status == status,
                                     _JOBS.c.finished_at == now)
    return list(session.execute(query).scalars())


def record_first_token(session: Session, job_id: str, attempt: int, at: datetime) -> bool:
    return _transition(
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
) -> bool:
    """running -> succeeded, only for the attempt that is running."""
    outcome = Completion(job_id, attempt, result_text, finish_reason, prompt_tokens, completion_tokens,
                         preemptions, first_token_at, logprobs, cached_tokens)
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


def cancel(session: Session, job_id: str, tenant_id: str, now: datetime) -> Job | None:
    """scheduled|queued|running -> cancelled. Returns the job as it now is (any status), or None if the tenant
    has no such job; the caller tells 'cancelled' from 'already finished' by its status."""
    _transition(
        session, job_id, (SCHEDULED, QUEUED, RUNNING), Job.tenant_id == tenant_id,
        status=CANCELLED, error_code="cancelled", error_message="cancelled by the client", finished_at=now,
        updated_at=now,
    )
    return get(session, job_id, tenant_id)


@dataclass(frozen=True)
class RetryResult:
    """What POST /v1/jobs/{id}/retry found: no such job (`job` None), a job run again by this call
    (`applied`), a replay of an Idempotency-Key an earlier retry used (`replayed`), one an open batch still
    holds (`open_batch_id`), or one not failed, cancelled or expired (none of the flags)."""

    job: Job | None
    applied: bool = False
    replayed: bool = False
    open_batch_id: str | None = None


_RESULT_FIELDS = ("result_text", "finish_reason", "completion_tokens", "cached_tokens", "logprobs", "choices",
                  "prompt_logprobs", "embeddings", "error_code", "error_message", "started_at",
                  "first_token_at", "finished_at", "worker_id", "dispatched_at", "predicted_finish_at")


def retry(session: Session, job_id: str, tenant_id: str, now: datetime, *, key: str | None = None,
          run_at: datetime | None = None) -> RetryResult:
    """failed|cancelled|expired -> queued (scheduled when `run_at` is ahead) under the same id: its outcome
    goes into its history, its result and error are cleared, its retries (core/retry_policy.py) start over,
    and its ttl and deadline count from now (or run_at). `key`: an Idempotency-Key; a retry that used it
    already makes this a replay. Committed."""
    query = select(Job).where(Job.id == job_id, Job.tenant_id == tenant_id).with_for_update()
    job = session.execute(query.execution_options(populate_existing=True)).scalar_one_or_none()
    replayed = job is not None and used_retry_key(job, key)
    if job is None or job.status not in RETRYABLE_STATUSES or replayed:
        session.rollback()
        return RetryResult(job, replayed=replayed)
    batch_id = open_batch_of(session, job_id)
    if batch_id is not None:
        session.rollback()
        return RetryResult(job, open_batch_id=batch_id)
    scheduled = run_at is not None and run_at > now
    since = run_at if run_at is not None and scheduled else now
    entry = outcome_entry(job) | ({"retry_key": key} if key is not None else {})
    values: dict[str, Any] = dict.fromkeys(_RESULT_FIELDS)
    values.update(status=SCHEDULED if scheduled else QUEUED, run_at=since,
                  history=with_entry(job, entry), retries=0, updated_at=now,
                  expires_at=since + timedelta(seconds=job.ttl_s) if job.ttl_s is not None else None)
    if job.deadline_at is not None:  # as far after the new start as it was after the old one
        ahead = job.deadline_at - (job.run_at or job.created_at)
        values["deadline_at"] = values["start_by"] = since + ahead
    applied = _update(session, job.id, (job.status,), None, **values)
    session.commit()
    return RetryResult(get(session, job_id, tenant_id), applied=applied)


def used_retry_key(job: Job, key: str | None) -> bool:
    """Whether a retry of the job already used this Idempotency-Key."""
    return key is not None and any(entry.get("retry_key") == key for entry in job.history or [])


@dataclass(frozen=True)
class AttemptState:
    status: str
    attempts: int
    worker_id: str | None


def attempt_states(session: Session, job_ids: list[str]) -> dict[str, AttemptState]:
    """Status, attempt number and holder of each job: a worker's check that its attempts are still current."""
    if not job_ids:
        return {}
    query = select(Job.id, Job.status, Job.attempts, Job.worker_id).where(Job.id.in_(job_ids))
    return {job_id: AttemptState(status, attempts, worker_id)
            for job_id, status, attempts, worker_id in session.execute(query)}


def cancel_queued(session: Session, lanes: list[str], tenant_id: str | None, now: datetime, limit: int,
                  ) -> list[str]:
    """scheduled|queued -> cancelled for up to `limit` jobs of `lanes` (a purge), oldest ids first, of
    `tenant_id` (None: every tenant's), with their effects (webhooks, counts, batch lines) as for any cancel;
    committed. Returns their ids."""
    owned = [Job.tenant_id == tenant_id] if tenant_id is not None else []
    waiting = Job.status.in_(WAITING_STATUSES)
    locked = lock_in_id_order(session, Job.queue.in_(lanes), waiting, *owned, limit=limit)
    statement = (
        update(Job).where(Job.id.in_(locked), waiting)
        .values(status=CANCELLED, error_code="cancelled", error_message="cancelled by a purge of its queue",
                finished_at=now, updated_at=now)
        .returning(Job.id).execution_options(synchronize_session=False)
    )
    ids = list(session.execute(statement).scalars()) if locked else []
    if ids:
        record_finished(session, ids, CANCELLED, now)
    session.commit()
    return ids


def lock_in_id_order(session: Session, *conditions: ColumnElement[bool], limit: int | None = None,
                     ) -> list[str]:
    """Locks the job rows matching `conditions` (the first `limit` of them) in id order and returns their
    ids (PostgreSQL: SELECT ... ORDER BY id FOR UPDATE; SQLite has one writer). Every transaction that
    changes several job rows and waits for their locks takes them this way first: two that locked in their
    own scan orders could each hold a row the other waits on, a deadlock PostgreSQL breaks by failing one of
    them (a batch cancel against a claim did). Sweeps that must not wait use `_unlocked` instead."""
    query = select(Job.id).where(*conditions).order_by(Job.id).limit(limit).with_for_update()
    return list(session.execute(query).scalars())


def _unlocked(*conditions: ColumnElement[bool]) -> Select[tuple[str]]:
    """Ids of the jobs matching `conditions` that no open transaction is changing (PostgreSQL: FOR UPDATE
    SKIP LOCKED; SQLite has one writer and ignores it). A sweep over many rows must not wait on one row: a
    worker frozen (SIGSTOP, a stalled VM) in the middle of a transaction holds its rows' locks until its
    session ends, and a plain UPDATE waiting on them would stall the whole fleet's reconcile with it. The
    skipped rows are swept in a later round, once that transaction has ended (the worker resumed, or its
    connection died)."""
    return select(Job.id).where(*conditions).with_for_update(skip_locked=True)


def fail_lost(session: Session, dead_worker_ids: list[str], now: datetime, max_attempts: int) -> list[str]:
    """running -> failed (`worker_lost`) for jobs held by dead workers that have used their retries: their
    own `max_retries`, else max_attempts - 1 (each requeue after a worker died counts one): a job that kills
    its worker every time must not take the fleet down one worker after another. Run before
    `requeue_orphans`, which requeues the rest. Commits; returns the ids."""
    if not dead_worker_ids:
        return []
    allowed = func.coalesce(Job.max_retries, max_attempts - 1)
    spent = [Job.status == RUNNING, Job.worker_id.in_(dead_worker_ids), Job.retries >= allowed]
    message = (f"the worker running this job died, and the job has used its retries (its max_retries, or "
               f"max_attempts ({max_attempts}) runs)")
    statement = (
        update(Job)
        .where(Job.id.in_(_unlocked(*spent)), *spent)
        .values(status=FAILED, error_code=WORKER_LOST, error_message=message, finished_at=now, updated_at=now)
        .returning(Job.id)
        .execution_options(synchronize_session=False)
    )
    ids = list(session.execute(statement).scalars())
    if ids:
        record_finished(session, ids, FAILED, now)
    session.commit()
    return ids


def requeue_orphans(session: Session, dead_worker_ids: list[str], now: datetime) -> list[tuple[str, str]]:
    """running -> queued for jobs held by dead workers; they are undispatched again, to be re-published."""
    if not dead_worker_ids:
        return []
    orphaned = [Job.status == RUNNING, Job.worker_id.in_(dead_worker_ids)]
    statement = (
        update(Job)
        .where(Job.id.in_(_unlocked(*orphaned)), *orphaned)
        .values(status=QUEUED, worker_id=None, dispatched_at=None, first_token_at=None, updated_at=now,
                retries=Job.retries + 1)
        .returning(Job.id, Job.queue)
        .execution_options(synchronize_session=False)
    )
    rows = [(job_id, queue) for job_id, queue in session.execute(statement)]
    session.commit()
    return rows


def adopt_bare_queued(session: Session, default_model: str, queue_names: list[str], now: datetime,
                      ) -> list[tuple[str, str]]:
    """Queued jobs whose `queue` is a bare queue name, as an API of the release before lanes wrote them during
    a rolling upgrade (migration 0017): moved to the default model's lane of that name and undispatched, to
    be published there; their tallies move with them (the tally triggers see status changes only). Returns
    (id, lane) of the jobs moved. One statement, an index probe per name (ix_jobs_queued)."""
    statement = (
        update(Job).where(status_is(QUEUED), Job.queue.in_(queue_names))
        .values(queue=lane_of(default_model, "") + Job.queue, dispatched_at=None, updated_at=now)
        .returning(Job.id, Job.tenant_id, Job.params, Job.queue)
        .execution_options(synchronize_session=False)
    )
    moved: list[tuple[str, str]] = []
    for job_id, tenant_id, params, lane in session.execute(statement).all():
        bound = output_bound(params or {})
        session.add_all([
            JobTallyDelta(queue=queue_of(lane), tenant_id=tenant_id, status=QUEUED, jobs=-1,
                          output_bound=-bound),
            JobTallyDelta(queue=lane, tenant_id=tenant_id, status=QUEUED, jobs=1, output_bound=bound),
        ])
        moved.append((job_id, lane))
    session.commit()
    return moved


def output_bound(params: dict[str, Any]) -> int:
    """The most output a job may still write, as the tally triggers count it (migration 0016)."""
    return int(params.get("max_tokens") or DEFAULT_MAX_TOKENS) * int(params.get("n") or 1)


def requeue_unheld(
    session: Session, worker_id: str, held: set[tuple[str, int]], started_before: datetime, now: datetime
) -> list[tuple[str, str]]:
    """running -> queued for this live worker's attempts that it does not hold: claimed, but the claim's
    answer never reached the runner (the connection dropped after the commit). Only attempts started before
    `started_before`, so a claim still on its way to the runner is left alone. The claim is given back
    (attempts - 1): the attempt never ran, so it neither shows as a run nor counts toward max_attempts."""
    query = select(Job.id, Job.attempts, Job.queue).where(
        Job.status == RUNNING, Job.worker_id == worker_id, Job.started_at < started_before)
    lost = [(job_id, attempt, queue) for job_id, attempt, queue in session.execute(query)
            if (job_id, attempt) not in held]
    requeued = []
    for job_id, attempt, queue in lost:
        still_held_here = and_(Job.worker_id == worker_id, Job.attempts == attempt)
        if _transition(session, job_id, (RUNNING,), still_held_here, status=QUEUED, attempts=attempt - 1,
                       worker_id=None, dispatched_at=None, first_token_at=None, updated_at=now):
            requeued.append((job_id, queue))
    return requeued


def expire_overdue(session: Session, now: datetime, job_ids: list[str] | None = None,
                   batch: int = EXPIRE_BATCH) -> list[str]:
    """queued jobs past expires_at -> expired (only those of `job_ids` when given); commits and returns
    their ids. `batch` at a time, the earliest expiry first, each committed: a wave of expiries never makes
    one long transaction, and the read follows ix_jobs_queued_expiry (the planner, misled by the finished
    rows' past expiries, would otherwise read every queued row to find none)."""
    overdue = [status_is(QUEUED), Job.expires_at.is_not(None), Job.expires_at <= now]
    if job_ids is not None:
        overdue.append(Job.id.in_(job_ids))
    due = _unlocked(*overdue).order_by(Job.expires_at).limit(batch)
    expired: list[str] = []
    while True:
        # Two statements, as in a claim: PostgreSQL may run an `IN (SELECT ... LIMIT)` again per row.
        ids = list(session.execute(due).scalars())
        if ids:
            statement = update(Job).where(Job.id.in_(ids), *overdue).values(**_expired_values(now))
            ids = list(session.execute(statement.returning(Job.id)
                                       .execution_options(synchronize_session=False)).scalars())
        if ids:
            record_finished(session, ids, EXPIRED, now)
        session.commit()
        expired += ids
        if len(ids) < batch:
            return expired


PROMOTE_BATCH = 500  # scheduled jobs made queued per statement (promote_due)


def promote_due(session: Session, now: datetime, batch: int = PROMOTE_BATCH) -> list[tuple[str, str]]:
    """scheduled -> queued (undispatched) for the jobs due by `now`, earliest due first, `batch` at a time,
    each batch committed; returns their (id, queue) in due order, to publish in that order. Rows another
    transaction holds are skipped (`_unlocked`): two schedulers never promote one job twice, and neither
    waits on the other. A process that dies after a commit leaves its jobs queued and undispatched: the
    reconciler publishes them (dispatch_grace_s)."""
    due = [status_is(SCHEDULED), Job.run_at <= now]
    promoted: list[tuple[str, str]] = []
    while True:
        ids = list(session.execute(_unlocked(*due).order_by(Job.run_at, Job.id).limit(batch)).scalars())
        rows: list[tuple[str, str, datetime]] = []
        if ids:
            statement = (update(Job).where(Job.id.in_(ids), *due)
                         .values(status=QUEUED, dispatched_at=None, updated_at=now)
                         .returning(Job.id, Job.queue, Job.run_at)
                         .execution_options(synchronize_session=False))
            rows = [(job_id, queue, run_at) for job_id, queue, run_at in session.execute(statement)]
        session.commit()
        promoted += [(job_id, queue) for job_id, queue, _ in sorted(rows, key=lambda row: (row[2], row[0]))]
        if len(ids) < batch:
            return promoted


def next_due(session: Session) -> datetime | None:
    """When the earliest scheduled job is due (ix_jobs_scheduled's first row); None: none is scheduled."""
    query = select(Job.run_at).where(status_is(SCHEDULED)).order_by(Job.run_at).limit(1)
    return session.execute(query).scalar_one_or_none()


def count_scheduled_in(session: Session, lane: str, tenant_id: str, *, up_to: int) -> int:
    """The tenant's scheduled jobs in `lane`, counted up to `up_to` (an admission check: bounded cost)."""
    rows = select(literal_column("1")).where(status_is(SCHEDULED), Job.queue == lane,
                                             Job.tenant_id == tenant_id).limit(up_to)
    return int(session.execute(select(func.count()).select_from(rows.subquery())).scalar_one())


def count_scheduled(session: Session, tenant_id: str | None = None) -> dict[str, int]:
    """Scheduled jobs per lane (not tallied: they join their queue's depth once due); with `tenant_id`,
    that tenant's only."""
    query = select(Job.queue, func.count()).where(status_is(SCHEDULED)).group_by(Job.queue)
    if tenant_id is not None:
        query = query.where(Job.tenant_id == tenant_id)
    return {queue: int(n) for queue, n in session.execute(query)}


def undispatched(session: Session, older_than: datetime) -> list[tuple[str, str]]:
    """(id, queue) of queued jobs never handed to the broker, created before `older_than`."""
    query = (
        select(Job.id, Job.queue)
        .where(status_is(QUEUED), Job.dispatched_at.is_(None), Job.created_at < older_than)
        .order_by(Job.created_at)
    )
    return [(job_id, queue) for job_id, queue in session.execute(query)]


def queued(session: Session) -> list[tuple[str, str]]:
    """(id, queue) of every queued job, oldest first (an embedded start reloads its in-process queues)."""
    query = select(Job.id, Job.queue).where(Job.status == QUEUED).order_by(Job.created_at)
    return [(job_id, queue) for job_id, queue in session.execute(query)]


def dispatched_but_queued(session: Session, queue: str, dispatched_before: datetime, limit: int,
                          ) -> list[tuple[str, str]]:
    """(id, queue) of the queue's jobs still queued though dispatched before `dispatched_before`, the
    earliest dispatched first, then the oldest (ix_jobs_dispatched_queued's order: the read stops at
    `limit`): candidates for a lost broker message."""
    query = (
        select(Job.id, Job.queue)
        .where(status_is(QUEUED), Job.queue == queue, Job.dispatched_at.is_not(None),
               Job.dispatched_at < dispatched_before)
        .order_by(Job.dispatched_at, Job.created_at, Job.id)
        .limit(limit)
    )
    return [(job_id, name) for job_id, name in session.execute(query)]


def mark_dispatched(session: Session, job_ids: list[str], now: datetime) -> None:
    if not job_ids:
        return
    queued = list(session.execute(_LOCK_QUEUED, {"b_ids": job_ids}).scalars())
    session.execute(_MARK_DISPATCHED, {"b_ids": queued, "b_now": now})
    session.commit()


# mark_dispatched's statements, built once (it runs for every group a relay publishes): the rows locked in
# id order first (lock_in_id_order's rule), then marked.
_LOCK_QUEUED = (select(Job.id).where(Job.id.in_(bindparam("b_ids", expanding=True)), Job.status == QUEUED)
                .order_by(Job.id).with_for_update())
_MARK_DISPATCHED = update(_JOBS).where(_JOBS.c.id.in_(bindparam("b_ids", expanding=True)),
                                       _JOBS.c.status == QUEUED).values(
    dispatched_at=bindparam("b_now", type_=_JOBS.c.dispatched_at.type))


# --- deleting ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobDeletion:
    """What DELETE found: no such job (`status` None), a job still queued or running (not deleted), one an
    open batch still holds (`open_batch_id`, not deleted), or a final job now deleted."""

    status: str | None
    deleted: bool = False
    open_batch_id: str | None = None


DELETABLE_STATUSES = (SCHEDULED, *TERMINAL_STATUSES)  # a scheduled job has not started: nothing runs it


def delete_finished(session: Session, job_id: str, tenant_id: str) -> JobDeletion:
    """Deletes the tenant's job, once final and no open batch holds it, with its webhook deliveries, in one
    transaction; commits. The DELETE is conditional on a final status, so a job that a worker is still
    running is never deleted under it."""
    status = session.execute(
        select(Job.status).where(Job.id == job_id, Job.tenant_id == tenant_id).with_for_update()
    ).scalar_one_or_none()
    if status is None or status not in DELETABLE_STATUSES:
        session.rollback()
        return JobDeletion(status)
    batch_id = open_batch_of(session, job_id)
    if batch_id is not None:
        session.rollback()
        return JobDeletion(status, open_batch_id=batch_id)
    deleted = delete_rows(session, tenant_id, [job_id], DELETABLE_STATUSES)
    session.commit()
    return JobDeletion(status, deleted=deleted == 1)


def open_batch_of(session: Session, job_id: str) -> str | None:
    """The batch still running that holds this job (its output is not written yet), or None."""
    query = (select(BatchLine.batch_id).join(Batch, Batch.id == BatchLine.batch_id)
             .where(BatchLine.job_id == job_id, Batch.status.in_(OPEN_BATCH_STATUSES)).limit(1))
    return session.execute(query).scalar_one_or_none()


def delete_rows(session: Session, tenant_id: str, job_ids: list[str],
                statuses: tuple[str, ...] | None = None) -> int:
    """Deletes the tenant's jobs of `job_ids` (only those in `statuses` when given) and the webhook
    deliveries about them; no commit. Returns how many jobs went."""
    if not job_ids:
        return 0
    webhooks.delete_for_subjects(session, tenant_id, "job", job_ids)
    statement = delete(Job).where(Job.id.in_(job_ids), Job.tenant_id == tenant_id)
    if statuses is not None:
        statement = statement.where(Job.status.in_(statuses))
    result = session.execute(statement.execution_options(synchronize_session=False))
    return int(result.rowcount)  # type: ignore[attr-defined]


def _expired_values(now: datetime) -> dict[str, Any]:
    return dict(status=EXPIRED, error_code="expired", error_message="ttl passed before the job started",
                finished_at=now, updated_at=now)


def _transition(
    session: Session, job_id: str, from_statuses: tuple[str, ...], condition: ColumnElement[bool] | None,
    **values: Any,
) -> bool:
    """One conditional UPDATE and its follow-on effects, committed; says whether a row changed."""
    applied = _update(session, job_id, from_statuses, condition, **values)
    if applied and values.get("status") in TERMINAL_STATUSES:
        record_finished(session, [job_id], values["status"], values["finished_at"])
    session.commit()
    return applied


def _update(
    session: Session, job_id: str, from_statuses: tuple[str, ...], condition: ColumnElement[bool] | None,
    **values: Any,
) -> bool:
    """The one conditional UPDATE behind every transition, not committed; says whether a row changed."""
    if "status" in values:
        assert all(values["status"] in JOB_TRANSITIONS[s] for s in from_statuses), (from_statuses, values)
    # On the table, not the mapped class: the ORM's bulk-update layer would double the cost of a statement
    # that runs for every job, and nothing here reads the rows back through the session.
    table = Job.__table__
    query = update(table).where(table.c.id == job_id, table.c.status.in_(from_statuses))
    if condition is not None:
        query = query.where(condition)
    result = session.execute(query.values(**values))
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]
