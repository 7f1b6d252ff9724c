"""Batches and their lines: rows, the runner's lease and read position, and the counters job outcomes feed.

A batch runner (worker/batches/runner.py) holding a batch's lease reads its input from `read_line` /
`read_offset`, and per chunk commits, in ONE transaction, the chunk's `batch_lines` (invalid lines as failed),
one queued job per valid line, and the new read position; the commit is fenced by the lease and the expected
position, so a runner that lost its lease can never insert a chunk twice. Job outcomes reach the lines and
the batch counters through `record_outcomes`, called by api/store/terminal.record_finished in the job
transition's own transaction: each job is counted exactly once.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.orm import Mapped, Session, mapped_column

from api.store.models import CANCELLED, EXPIRED, FAILED, QUEUED, RUNNING, SUCCEEDED, Base, Job, UTCDateTime
from api.store.paging import newest_first

# OpenAI's batch statuses.
VALIDATING, IN_PROGRESS, FINALIZING, COMPLETED = "validating", "in_progress", "finalizing", "completed"
BATCH_FAILED, BATCH_EXPIRED, CANCELLING, BATCH_CANCELLED = "failed", "expired", "cancelling", "cancelled"
BATCH_STATUSES = (VALIDATING, IN_PROGRESS, FINALIZING, COMPLETED, BATCH_FAILED, BATCH_EXPIRED, CANCELLING,
                  BATCH_CANCELLED)
OPEN_STATUSES = (VALIDATING, IN_PROGRESS, FINALIZING, CANCELLING)  # a runner still has work to do
# Why a batch stopped early (None: it ran to the end of its input).
STOP_FAILED, STOP_EXPIRED = "failed", "expired"

# A line's status: `queued` while its job is queued or running, then its outcome.
LINE_QUEUED, LINE_SUCCEEDED, LINE_FAILED, LINE_CANCELLED = "queued", "succeeded", "failed", "cancelled"
_LINE_OUTCOME = {SUCCEEDED: LINE_SUCCEEDED, FAILED: LINE_FAILED, EXPIRED: LINE_FAILED,
                 CANCELLED: LINE_CANCELLED}


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


@dataclass(frozen=True)
class ChunkPosition:
    """The read position a chunk starts from and the one after it."""

    start_line: int
    next_line: int
    next_offset: int
    done: bool


def new_batch_id() -> str:
    return "batch_" + uuid.uuid4().hex


def create(session: Session, *, tenant_id: str, input_url: str, output_url: str | None, queue: str,
           now: datetime, input_file_id: str | None = None, endpoint: str | None = None,
           completion_window_s: float = 86400.0, webhook: dict[str, Any] | None = None,
           meta: dict[str, Any] | None = None) -> Batch:
    """Inserts a validating batch and commits; a runner picks it up on its next round."""
    batch = Batch(
        id=new_batch_id(), tenant_id=tenant_id, endpoint=endpoint, input_url=input_url,
        input_file_id=input_file_id, output_url=output_url, queue=queue,
        completion_window=f"{round(completion_window_s / 3600)}h", webhook=webhook, meta=meta,
        status=VALIDATING, total=0, completed=0, failed=0, cancelled=0, prompt_tokens=0, completion_tokens=0,
        read_line=1, read_offset=0, read_done=False, created_at=now,
        expires_at=now + timedelta(seconds=completion_window_s), updated_at=now,
    )
    session.add(batch)
    session.commit()
    return batch


def get(session: Session, batch_id: str, tenant_id: str | None = None) -> Batch | None:
    query = select(Batch).where(Batch.id == batch_id).execution_options(populate_existing=True)
    if tenant_id is not None:
        query = query.where(Batch.tenant_id == tenant_id)
    return session.execute(query).scalar_one_or_none()


def page(session: Session, tenant_id: str, *, limit: int, after: str | None = None) -> list[Batch]:
    """Newest first; `after` is the last batch id of the previous page (an unknown id gives an empty page)."""
    query = select(Batch).where(Batch.tenant_id == tenant_id)
    before = None
    if after is not None:
        last = get(session, after, tenant_id)
        if last is None:
            return []
        before = (last.created_at, last.id)
    return list(session.execute(newest_first(query, Batch, limit=limit, before=before)).scalars())


# --- cancel and job outcomes ------------------------------------------------------------------------


def request_cancel(session: Session, batch_id: str, tenant_id: str, now: datetime) -> Batch | None:
    """validating|in_progress -> cancelling, cancelling the batch's queued and running jobs in the same
    transaction. Returns the batch as it now is, or None if the tenant has no such batch."""
    batch = get(session, batch_id, tenant_id)
    if batch is None:
        return None
    if batch.status in (VALIDATING, IN_PROGRESS):
        cancel_active_jobs(session, batch_id, now)
        session.execute(
            update(Batch).where(Batch.id == batch_id, Batch.status.in_((VALIDATING, IN_PROGRESS)))
            .values(status=CANCELLING, cancelling_at=now, updated_at=now)
            .execution_options(synchronize_session=False)
        )
    session.commit()
    return get(session, batch_id, tenant_id)


def cancel_active_jobs(session: Session, batch_id: str, now: datetime) -> list[str]:
    """queued|running -> cancelled for the batch's jobs; counted through record_finished. No commit."""
    from api.store.terminal import record_finished  # terminal imports this module

    active = select(BatchLine.job_id).where(BatchLine.batch_id == batch_id, BatchLine.status == LINE_QUEUED)
    statement = (
        update(Job).where(Job.id.in_(active), Job.status.in_((QUEUED, RUNNING)))
        .values(status=CANCELLED, error_code="cancelled", error_message="the batch was cancelled",
                finished_at=now, updated_at=now)
        .returning(Job.id).execution_options(synchronize_session=False)
    )
    ids = list(session.execute(statement).scalars())
    if ids:
        record_finished(session, ids, CANCELLED, now)
    return ids


def record_outcomes(session: Session, job_ids: list[str], status: str, now: datetime) -> None:
    """The batch side of a job reaching `status`: its line's status and its batch's counters. Runs inside the
    job transition's transaction; lines already past `queued` are left alone, so nothing counts twice."""
    statement = (
        update(BatchLine).where(BatchLine.job_id.in_(job_ids), BatchLine.status == LINE_QUEUED)
        .values(status=_LINE_OUTCOME[status])
        .returning(BatchLine.batch_id, BatchLine.job_id).execution_options(synchronize_session=False)
    )
    rows = session.execute(statement).all()
    if not rows:
        return
    tokens = _tokens_by_batch(session, rows) if status == SUCCEEDED else {}
    counter = {SUCCEEDED: Batch.completed, CANCELLED: Batch.cancelled}.get(status, Batch.failed)
    for batch_id, n in sorted(Counter(batch_id for batch_id, _ in rows).items()):  # a fixed lock order
        prompt, completion = tokens.get(batch_id, (0, 0))
        session.execute(
            update(Batch).where(Batch.id == batch_id)
            .values({counter: counter + n, Batch.prompt_tokens: Batch.prompt_tokens + prompt,
                     Batch.completion_tokens: Batch.completion_tokens + completion, Batch.updated_at: now})
            .execution_options(synchronize_session=False)
        )


def _tokens_by_batch(session: Session, rows: list[Any]) -> dict[str, tuple[int, int]]:
    batch_of = {job_id: batch_id for batch_id, job_id in rows}
    query = select(Job.id, Job.prompt_tokens, Job.completion_tokens).where(Job.id.in_(list(batch_of)))
    totals: dict[str, tuple[int, int]] = {}
    for job_id, prompt, completion in session.execute(query):
        before = totals.get(batch_of[job_id], (0, 0))
        totals[batch_of[job_id]] = (before[0] + (prompt or 0), before[1] + (completion or 0))
    return totals


# --- the runner's lease -----------------------------------------------------------------------------


def claimable(session: Session, owner: str, now: datetime, limit: int) -> list[str]:
    """Open batches whose lease is free, expired or already ours, oldest first."""
    free = or_(Batch.lease_owner.is_(None), Batch.lease_expires_at < now, Batch.lease_owner == owner)
    query = (select(Batch.id).where(Batch.status.in_(OPEN_STATUSES), free)
             .order_by(Batch.created_at).limit(limit))
    return list(session.execute(query).scalars())


def take_lease(session: Session, batch_id: str, owner: str, now: datetime, lease_s: float) -> bool:
    """Takes or renews the lease (free, expired, or ours); validating -> in_progress on first take."""
    free = or_(Batch.lease_owner.is_(None), Batch.lease_expires_at < now, Batch.lease_owner == owner)
    result = session.execute(
        update(Batch).where(Batch.id == batch_id, Batch.status.in_(OPEN_STATUSES), free)
        .values(lease_owner=owner, lease_expires_at=now + timedelta(seconds=lease_s), updated_at=now)
        .execution_options(synchronize_session=False)
    )
    taken: bool = result.rowcount == 1  # type: ignore[attr-defined]
    if taken:
        session.execute(
            update(Batch).where(Batch.id == batch_id, Batch.status == VALIDATING)
            .values(status=IN_PROGRESS, in_progress_at=now).execution_options(synchronize_session=False)
        )
    session.commit()
    return taken


def release_lease(session: Session, batch_id: str, owner: str) -> None:
    session.execute(
        update(Batch).where(Batch.id == batch_id, Batch.lease_owner == owner)
        .values(lease_owner=None, lease_expires_at=None).execution_options(synchronize_session=False)
    )
    session.commit()


# --- reading the input ------------------------------------------------------------------------------


def active_lines(session: Session, batch_id: str) -> int:
    query = select(func.count()).select_from(BatchLine).where(
        BatchLine.batch_id == batch_id, BatchLine.status == LINE_QUEUED
    )
    return int(session.execute(query).scalar_one())


def seen_custom_ids(session: Session, batch_id: str) -> set[str]:
    query = select(BatchLine.custom_id).where(BatchLine.batch_id == batch_id,
                                              BatchLine.custom_id.is_not(None))
    return {custom_id for (custom_id,) in session.execute(query)}


def commit_chunk(session: Session, batch_id: str, owner: str, position: ChunkPosition,
                 lines: list[BatchLine], new_jobs: list[Job], now: datetime) -> bool:
    """Inserts the chunk's lines and jobs and advances the read position, all or nothing. False (rolled
    back) when the lease is no longer ours, the batch stopped running, or another runner got here first."""
    invalid = sum(1 for line in lines if line.status == LINE_FAILED)
    result = session.execute(
        update(Batch).where(Batch.id == batch_id, Batch.lease_owner == owner, Batch.status == IN_PROGRESS,
                            Batch.read_line == position.start_line)
        .values(read_line=position.next_line, read_offset=position.next_offset, read_done=position.done,
                total=Batch.total + len(lines), failed=Batch.failed + invalid, updated_at=now)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        session.rollback()
        return False
    session.add_all(new_jobs)
    session.flush()  # jobs before the lines that name them
    session.add_all(lines)
    session.commit()
    return True


# --- finishing --------------------------------------------------------------------------------------


def stop(session: Session, batch_id: str, owner: str, reason: str, errors: list[dict[str, Any]] | None,
         now: datetime) -> bool:
    """in_progress -> finalizing early (input unreadable, or past expires_at); its active jobs are
    cancelled. A batch already cancelling stays so."""
    cancel_active_jobs(session, batch_id, now)
    result = session.execute(
        update(Batch).where(Batch.id == batch_id, Batch.lease_owner == owner, Batch.status == IN_PROGRESS)
        .values(status=FINALIZING, stop_reason=reason, errors=errors, finalizing_at=now, updated_at=now)
        .execution_options(synchronize_session=False)
    )
    session.commit()
    return result.rowcount == 1  # type: ignore[attr-defined,no-any-return]


def start_finalizing(session: Session, batch_id: str, owner: str, now: datetime) -> bool:
    """in_progress -> finalizing once the input is read and no line is queued or running."""
    no_active = ~select(BatchLine.line).where(BatchLine.batch_id == batch_id,
                                              BatchLine.status == LINE_QUEUED).exists()
    result = session.execute(
        update(Batch).where(Batch.id == batch_id, Batch.lease_owner == owner, Batch.status == IN_PROGRESS,
                            Batch.read_done.is_(True), no_active)
        .values(status=FINALIZING, finalizing_at=now, updated_at=now)
        .execution_options(synchronize_session=False)
    )
    session.commit()
    return result.rowcount == 1  # type: ignore[attr-defined,no-any-return]


def lines_in_order(session: Session, batch_id: str, yield_per: int = 500,
                   ) -> Iterator[tuple[BatchLine, Job | None]]:
    """Every line of the batch by line number, with its job; streamed, never all in memory."""
    query = (
        select(BatchLine, Job).outerjoin(Job, Job.id == BatchLine.job_id)
        .where(BatchLine.batch_id == batch_id).order_by(BatchLine.line)
        .execution_options(yield_per=yield_per)
    )
    for line, job in session.execute(query):  # noqa: UP028 (rows, unpacked into plain tuples)
        yield line, job


def final_status(batch: Batch) -> str:
    if batch.status == CANCELLING:
        return BATCH_CANCELLED
    return {STOP_FAILED: BATCH_FAILED, STOP_EXPIRED: BATCH_EXPIRED}.get(batch.stop_reason or "", COMPLETED)


def finish(session: Session, batch_id: str, owner: str, now: datetime, *, status: str, unread: int,
           outputs: dict[str, str], output_file_id: str | None, error_file_id: str | None) -> Batch | None:
    """finalizing|cancelling -> its final status, with the outputs written and the lines never read counted
    as cancelled. No commit: the caller adds the files and the webhook event to this transaction. None when
    the lease was lost."""
    result = session.execute(
        update(Batch).where(Batch.id == batch_id, Batch.lease_owner == owner,
                            Batch.status.in_((FINALIZING, CANCELLING)))
        .values(status=status, total=Batch.total + unread, cancelled=Batch.cancelled + unread,
                outputs=outputs, output_file_id=output_file_id, error_file_id=error_file_id,
                finished_at=now, updated_at=now, lease_owner=None, lease_expires_at=None, read_done=True)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        session.rollback()
        return None
    return get(session, batch_id)


# --- the public shape -------------------------------------------------------------------------------


def to_public(batch: Batch) -> dict[str, Any]:
    """The batch as `GET /v1/batches/{id}` shows it (OpenAI's Batch object plus Conveyor's fields); also the
    body of batch.* webhook events, hence here and not in the HTTP layer."""
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
        "outputs": batch.outputs, "queue": batch.queue,
        "webhook": {"url": batch.webhook["url"]} if batch.webhook else None,
    }


def _unix(when: datetime | None) -> int | None:
    return None if when is None else int(when.timestamp())
