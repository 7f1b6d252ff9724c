"""Every table of the store, in one place: `Base.metadata` is the schema `migrations/` builds (Alembic).

Tenants and their API keys; jobs; worker registrations; batches and their lines; files; webhook signing
secrets, subscriptions, deliveries and their attempts; the console's sessions. Queries live beside them, one
module per subject (jobs.py, batches.py, ...). Statuses are in core/lifecycle.py.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.sql import false, text
from sqlalchemy.types import TypeDecorator

from conveyor.core.protocol.job_kinds import GENERATION

DEFAULT_TENANT = "default"  # created by the first migration; the tenant of every request when auth is off


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend.

    NOTE: SQLite keeps no offset, so values are stored as naive UTC (whose text sorts chronologically) and
    given back their UTC tzinfo on the way out; Postgres keeps `timestamptz`.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        assert value.tzinfo is not None, "store datetimes must be timezone-aware"
        value = value.astimezone(timezone.utc)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


class Base(DeclarativeBase):
    pass


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    # Per-tenant overrides of the settings' defaults; NULL: the default applies.
    weight: Mapped[float | None] = mapped_column(Float, nullable=True)  # fair-share weight within a queue
    max_queued: Mapped[int | None] = mapped_column(Integer, nullable=True)  # queued jobs, per queue
    max_running: Mapped[int | None] = mapped_column(Integer, nullable=True)  # running jobs, per queue
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)  # prompt + output
    retention_days: Mapped[int | None] = mapped_column(Integer, nullable=True)  # finished data kept
    # The prefix cache's partition its jobs use (core/store/tenants.py cache_salt); NULL: its own, shared
    # with no other tenant. Tenants given the same name see each other's cached prefixes.
    cache_namespace: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # The priorities its jobs may ask for (lower is more urgent); NULL: unbounded on that side.
    min_priority: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_priority: Mapped[int | None] = mapped_column(Integer, nullable=True)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    prefix: Mapped[str] = mapped_column(String(16))  # shown in listings; the key itself is never stored
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the full key
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())  # sees all tenants


# Partial indexes over the rows the per-job and per-round queries read (migration 0014): their cost follows
# the backlog, not the history. A query uses one only when its WHERE implies the index's: see
# core/store/jobs/transitions.py status_is, which writes the status into the SQL for that reason.
PARTIAL_INDEXES: dict[str, tuple[list[str], str]] = {
    "ix_jobs_queued": (["queue", "tenant_id", "batch_id", "created_at", "id"], "status = 'queued'"),
    # A stream's claim in urgency order (core/store/queued_streams.py most_urgent; migration 0015).
    "ix_jobs_queued_urgency": (["queue", "tenant_id", "batch_id", "priority", "created_at", "id"],
                               "status = 'queued'"),
    "ix_jobs_queued_slack": (["queue", "tenant_id", "batch_id", "priority", "start_by", "created_at", "id"],
                             "status = 'queued' AND deadline_at IS NOT NULL"),
    "ix_jobs_queued_expiry": (["expires_at"], "status = 'queued' AND expires_at IS NOT NULL"),
    "ix_jobs_undispatched": (["created_at"], "status = 'queued' AND dispatched_at IS NULL"),
    "ix_jobs_dispatched_queued": (["queue", "dispatched_at", "created_at", "id"],
                                  "status = 'queued' AND dispatched_at IS NOT NULL"),
    "ix_jobs_succeeded_finished": (["queue", "finished_at"], "status = 'succeeded'"),
    "ix_jobs_deadline_finished": (["finished_at"], "deadline_at IS NOT NULL"),
    # The scheduler's due sweep, earliest first (worker/promoter.py; migration 0020).
    "ix_jobs_scheduled": (["run_at", "id"], "status = 'scheduled'"),
    # The console's failures of the last hour (api/console/jobs.py; migration 0021).
    "ix_jobs_failed_finished": (["finished_at"], "status IN ('failed', 'expired')"),
}


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("tenant_id", "idempotency_key", name="uq_jobs_tenant_idempotency_key"),
        Index("ix_jobs_tenant_created", "tenant_id", "created_at", "id"),
        Index("ix_jobs_created", "created_at", "id"),  # trace exports page by it (core/store/trace_rows.py)
        Index("ix_jobs_status_queue", "status", "queue"),
        *(Index(name, *columns, postgresql_where=text(where), sqlite_where=text(where))
          for name, (columns, where) in PARTIAL_INDEXES.items()),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    queue: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    # What the job asks of its model (core/protocol/job_kinds.py): text from a prompt or messages
    # (generation), or a vector per input (embedding).
    kind: Mapped[str] = mapped_column(String(16), default=GENERATION, server_default=GENERATION)
    prompt: Mapped[str | None] = mapped_column(Text, nullable=True)
    # An embedding job's inputs, each a text or a list of token ids; a completion's prompts, each a text or
    # token ids, when they are token ids or several (core/protocol/completion_prompts.py; `prompt` is NULL
    # then); NULL otherwise.
    inputs: Mapped[list[str | list[int]] | None] = mapped_column(JSON, nullable=True)
    messages: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    params: Mapped[dict[str, Any]] = mapped_column(JSON)  # core/protocol/job_params.py JobParams' stored form
    # How the messages are rendered and the answer read (core/protocol/chat_options.py); NULL: the defaults.
    chat: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # `metadata` is reserved on declarative classes, hence the attribute name.
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON, nullable=True)
    webhook: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    idempotency_key: Mapped[str | None] = mapped_column(String(255), nullable=True)
    request_hash: Mapped[str] = mapped_column(String(64))
    ttl_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    # When a `scheduled` job is due (asked with run_at or delay_s, or a retry's backoff); kept once it ran.
    run_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # Earlier attempts' outcomes, oldest first, kept when the job was retried (core/store/jobs/history.py).
    history: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    # Automatic retries of retryable failures (core/retry_policy.py): allowed (NULL: the queue's default)
    # and used since submission or the last retry on request.
    max_retries: Mapped[int | None] = mapped_column(Integer, nullable=True)
    retries: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Urgency within the queue (fleet claims, engine admission and preemption): priority, lower first, then
    # deadline_at (a soft target: created_at + deadline_s) while it is ahead, then arrival.
    priority: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    deadline_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # The latest start that still meets deadline_at (deadline_at minus its predicted run time): claims order
    # by it while the deadline is ahead, so a long job due soon goes before a short one due a little sooner.
    start_by: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # When submit predicted it would finish (core/store/finish_times.py); NULL: no prediction.
    predicted_finish_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    service_tier: Mapped[str | None] = mapped_column(String(16), nullable=True)  # as asked; NULL: none
    timeout_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    first_token_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    preemptions: Mapped[int] = mapped_column(Integer, default=0)
    result_text: Mapped[str | None] = mapped_column(Text, nullable=True)
    finish_reason: Mapped[str | None] = mapped_column(String(16), nullable=True)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    completion_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    cached_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)  # from the prefix cache
    # Speculative decoding: tokens drafted for the job's choices, and those of them the model accepted (0 when
    # its model does not speculate; NULL for a job finished before 0023 or not succeeded).
    draft_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    accepted_draft_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Per generated token when the job asked for logprobs: {token_id, text, logprob, top_logprobs: [...]}.
    logprobs: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    # A job that asked for n > 1, or has `inputs` prompts: every choice {index, text, finish_reason,
    # completion_tokens, logprobs}, choice c of prompt p at index p * n + c; the first choice of each of its
    # `inputs` prompts also keeps that prompt as read, `prompt`: {text (token ids decoded), logprobs (as
    # prompt_logprobs; null when not asked)}. result_text, finish_reason and logprobs are choice 0's,
    # completion_tokens their sum; prompt_tokens and cached_tokens count every prompt.
    choices: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    # When the job asked for prompt_logprobs: per prompt token {token_id, text, logprob, top_logprobs}, the
    # first one's logprob null (nothing precedes it); of its first prompt when it has several.
    prompt_logprobs: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    # A job submitted through POST /v1/responses: what that request said beyond the job's own fields
    # (core/protocol/responses_request.py ResponseCreate.stored()); SQL NULL (not JSON null: none_as_null) for
    # every other job, so that "is it a response" is a cheap IS NOT NULL.
    responses_request: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    # A succeeded embedding job's vectors, one per input in order, each its float32 components little-endian
    # and base64-encoded (core/views/embedding_vectors.py); its usage is prompt_tokens.
    embeddings: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    error_code: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_message: Mapped[str | None] = mapped_column(Text, nullable=True)
    worker_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    dispatched_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())
    # The batch whose line this job answers, set by the batch runner only (NULL: the tenant's own
    # submission): fair share's streams (core/store/fair_share.py). A client's metadata is only metadata.
    batch_id: Mapped[str | None] = mapped_column(ForeignKey("batches.id", name="fk_jobs_batch_id"),
                                                nullable=True, index=True)


class Worker(Base):
    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    queues: Mapped[list[str]] = mapped_column(JSON)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime())
    last_seen_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    stopped_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # Its engine's pace (engine/pace.py Pace.to_json(), once measured) and load (kv_used, running, waiting,
    # preemptions: worker/services.py engine_load), published with its heartbeat; NULL: not yet.
    rates: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class Batch(Base):
    __tablename__ = "batches"
    __table_args__ = (
        Index("ix_batches_tenant_created", "tenant_id", "created_at", "id"),
        Index("ix_batches_status", "status"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64))
    endpoint: Mapped[str | None] = mapped_column(String(64), nullable=True)  # None: each line says
    input_url: Mapped[str] = mapped_column(Text)  # s3://bucket/key, or the input file's blob URL
    input_file_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    output_url: Mapped[str | None] = mapped_column(Text, nullable=True)  # s3://bucket/prefix/; None: files
    queue: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    webhook: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON, nullable=True)
    status: Mapped[str] = mapped_column(String(16))
    stop_reason: Mapped[str | None] = mapped_column(String(16), nullable=True)
    total: Mapped[int] = mapped_column(Integer, default=0)  # lines read so far (all, once finished)
    # The requests it was created with, when known then (a Message Batch's body lists them); None: counted in
    # `total` as the input is read.
    request_count: Mapped[int | None] = mapped_column(Integer, nullable=True)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)  # invalid lines and failed jobs
    cancelled: Mapped[int] = mapped_column(Integer, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    read_line: Mapped[int] = mapped_column(Integer, default=1)  # the number the next line gets
    read_offset: Mapped[int] = mapped_column(BigInteger, default=0)  # where the next line starts
    read_done: Mapped[bool] = mapped_column(Boolean, default=False)
    lease_owner: Mapped[str | None] = mapped_column(String(128), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # Rounds that failed in a row (reset by one that does not), when the next may start, and why the last
    # failed: in the row, so the backoff holds across runners and restarts (worker/batches/runner.py).
    failure_count: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    next_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    run_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)  # asked start; NULL: now
    last_failure: Mapped[str | None] = mapped_column(Text, nullable=True)
    output_file_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    outputs: Mapped[dict[str, str] | None] = mapped_column(JSON, nullable=True)  # results/errors/manifest
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)  # batch-level errors
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    in_progress_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finalizing_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    cancelling_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class BatchLine(Base):
    __tablename__ = "batch_lines"
    __table_args__ = (
        UniqueConstraint("batch_id", "custom_id", name="uq_batch_lines_custom_id"),
        Index("ix_batch_lines_batch_status", "batch_id", "status"),
    )

    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id"), primary_key=True)
    line: Mapped[int] = mapped_column(Integer, primary_key=True)
    # The line's custom_id when it is the first to use it; NULL for duplicates and lines without one
    # (their error keeps what they said).
    custom_id: Mapped[str | None] = mapped_column(String(512), nullable=True)
    status: Mapped[str] = mapped_column(String(16))
    job_id: Mapped[str | None] = mapped_column(String(40), nullable=True, index=True)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)  # code, message, custom_id


class File(Base):
    __tablename__ = "files"
    __table_args__ = (Index("ix_files_tenant_created", "tenant_id", "created_at", "id"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64))
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(255))
    bytes: Mapped[int] = mapped_column(BigInteger)
    url: Mapped[str] = mapped_column(Text)  # a local path (embedded) or an s3:// URL; never shown to clients
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class SigningSecret(Base):
    """A tenant's `whsec_` secret. The current one has no `expires_at`; a rotated-out one keeps signing until
    its `expires_at`. Stored retrievably because it must sign; shown to the tenant only when created."""

    __tablename__ = "webhook_secrets"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    secret: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)

    def __repr__(self) -> str:   # never the secret
        return f"SigningSecret(id={self.id!r}, tenant_id={self.tenant_id!r}, expires_at={self.expires_at!r})"


class Subscription(Base):
    __tablename__ = "webhook_subscriptions"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    url: Mapped[str] = mapped_column(Text)
    events: Mapped[list[str]] = mapped_column(JSON)   # filter patterns; empty = every event
    description: Mapped[str | None] = mapped_column(Text, nullable=True)
    enabled: Mapped[bool] = mapped_column(Boolean)
    disabled_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class Delivery(Base):
    """One event to one target. `id` is the `webhook-id` header, the same on every attempt and resend."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
        Index("ix_webhook_deliveries_subject", "tenant_id", "subject_type", "subject_id"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64))
    subscription_id: Mapped[str | None] = mapped_column(String(40), nullable=True)   # None: the job's own
    url: Mapped[str] = mapped_column(Text)
    event_type: Mapped[str] = mapped_column(String(32))
    subject_type: Mapped[str] = mapped_column(String(16))   # "job" or "batch"
    subject_id: Mapped[str] = mapped_column(String(64))
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)   # the event, frozen when it happened
    status: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(Integer)           # attempts started (claimed)
    schedule_start: Mapped[int] = mapped_column(Integer)     # attempts before the current retry schedule
    next_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class Attempt(Base):
    __tablename__ = "webhook_attempts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    delivery_id: Mapped[str] = mapped_column(ForeignKey("webhook_deliveries.id"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    attempted_at: Mapped[datetime] = mapped_column(UTCDateTime())
    outcome: Mapped[str] = mapped_column(String(16))   # delivered | retry | disabled | failed
    status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    duration_s: Mapped[float] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    response_excerpt: Mapped[str | None] = mapped_column(Text, nullable=True)
    next_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class MetricCount(Base):
    """Cluster-wide counters of final outcomes (core/store/outcome_counts.py), one row per series: written
    in the same transaction as the job's final transition (or the webhook attempt), so each is counted once
    whichever process records it, and kept when retention deletes the jobs. A histogram has one row per
    bucket (non-cumulative: `label` is the bucket's upper bound) with the sum of its observations."""

    __tablename__ = "metric_counts"

    metric: Mapped[str] = mapped_column(String(64), primary_key=True)
    queue: Mapped[str] = mapped_column(String(64), primary_key=True)   # "" when not per queue
    status: Mapped[str] = mapped_column(String(16), primary_key=True)  # "" when not per status
    label: Mapped[str] = mapped_column(String(64), primary_key=True)   # bucket bound, error code, outcome
    count: Mapped[int] = mapped_column(BigInteger)
    total: Mapped[float] = mapped_column(Float)  # sum of the observations (histograms)


class JobTally(Base):
    """A queue's and tenant's jobs in one status (scheduled, queued or running) and the output they may still
    write (max_tokens x n), as of the last fold of job_tally_deltas (core/store/job_tallies.py)."""

    __tablename__ = "job_tallies"

    queue: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    status: Mapped[str] = mapped_column(String(16), primary_key=True)
    jobs: Mapped[int] = mapped_column(BigInteger)
    output_bound: Mapped[int] = mapped_column(BigInteger)


class JobTallyDelta(Base):
    """One job entering (+1) or leaving (-1) a tallied status, written by the triggers on jobs (migrations
    0016 and 0026) in the transaction that moved it."""

    __tablename__ = "job_tally_deltas"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer(), "sqlite"), primary_key=True,
                                    autoincrement=True)
    queue: Mapped[str] = mapped_column(String(64))
    tenant_id: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    jobs: Mapped[int] = mapped_column(BigInteger)
    output_bound: Mapped[int] = mapped_column(BigInteger)


class BrokerRepublish(Base):
    """The walk that publishes every queued job again after the broker lost its queues (core/store/
    republish_walk.py): one row (id 1), absent until the first walk."""

    __tablename__ = "broker_republish"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    generation: Mapped[int] = mapped_column(BigInteger)  # walks begun: one per loss of the broker's queues
    # Messages published before this may be lost: the jobs dispatched before it are walked. NULL: no walk
    # under way.
    lost_before: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    lane: Mapped[str | None] = mapped_column(String(64), nullable=True)  # the lane being walked
    # The last job published again in `lane`, by ix_jobs_dispatched_queued's key; NULL: none yet.
    after_dispatched_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    after_created_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    after_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    published: Mapped[int] = mapped_column(BigInteger)  # jobs published again in this generation so far


class LoraAdapter(Base):
    """A LoRA adapter loaded at run time (POST /v1/load_lora_adapter; core/store/lora_adapters.py), served
    under `name` by the workers of `model_id`. Those declared in the configuration are not stored."""

    __tablename__ = "lora_adapters"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    model_id: Mapped[str] = mapped_column(String(128))
    path: Mapped[str] = mapped_column(String(1024))  # a PEFT folder the workers can read, or s3://...
    tenants: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)  # NULL: every tenant
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class ConsoleSession(Base):
    """A session of the operator console (core/store/console_sessions.py): opened by a sign-in (auth on) or
    by the first page (auth off), ended by signing out or by its expiry. Known by a random secret, the
    cookie's value; the store keeps its SHA-256 only."""

    __tablename__ = "console_sessions"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # sha256 hex of the session's secret
    key_id: Mapped[str | None] = mapped_column(String(40), nullable=True)  # its API key; NULL: auth off
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
