"""New job rows: the one constructor of every door's jobs, and the inserts (one job, or many rows at once)."""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session, configure_mappers

from conveyor.core.lifecycle import QUEUED, SCHEDULED
from conveyor.core.protocol.job_kinds import GENERATION
from conveyor.core.store.tables import Job


@dataclass(frozen=True)
class NewJob:
    """A job as any door submits it (the job API, the OpenAI routes, a batch line), judged by the request
    rules (core/protocol/request_limits.py) before it gets here."""

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
    chat: dict[str, Any] | None = None  # core/protocol/chat_options.py's stored form
    priority: int = 0  # lower first
    deadline_s: float | None = None  # soft target, seconds after submission
    predicted_finish_at: datetime | None = None  # submit's prediction, when it made one
    start_by: datetime | None = None  # latest start meeting the deadline (finish_times.forecast)
    service_tier: str | None = None  # the OpenAI service tier asked for
    # An embedding job (core/protocol/job_kinds.py) has `inputs` (each a text or token ids) and neither prompt
    # nor messages; its params are core/protocol/embedding_request.py's job_params.
    kind: str = GENERATION
    inputs: list[str | list[int]] | None = None
    run_at: datetime | None = None  # due then (status scheduled until); None: queued at once
    max_retries: int | None = None  # automatic retries of retryable failures (core/retry_policy.py)
    responses_request: dict[str, Any] | None = None  # a Responses API request's own fields (tables.py)


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
    return detached(row)


def detached(values: dict[str, Any]) -> Job:
    """A Job holding `values` (keyed by Job's attributes), in no session, for reading only. Filled as the ORM
    fills a row it loads, without the ~50 attribute events of `Job(**values)`, which cost more CPU than
    the insert itself."""
    configure_mappers()  # returns at once once done; a Job's attributes work only after it
    job: Job = Job.__mapper__.class_manager.new_instance()
    job.__dict__.update(values)
    return job


def build_row(new: NewJob, now: datetime) -> dict[str, Any]:
    """The queued job row of `new` keyed by its table's columns, for `insert_rows` (a batch chunk's jobs: one
    executemany, no ORM object per job)."""
    return _by_column(_queued_row(new, now))


def insert_rows(session: Session, rows: list[dict[str, Any]]) -> None:
    """Inserts rows made by `build_row` in one executemany. No commit: the caller's transaction."""
    if rows:
        session.execute(_INSERT_JOB, rows)


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
        kind=new.kind, inputs=new.inputs, responses_request=new.responses_request,
    )
