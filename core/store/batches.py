"""Batches and their lines: rows, the runner's lease and read position, and the counters job outcomes feed.

A batch runner (worker/batches/runner.py) holding a batch's lease reads its input from `read_line` /
`read_offset`, and per chunk commits, in ONE transaction, the chunk's `batch_lines` (invalid lines as failed),
one queued job per valid line, and the new read position; the commit is fenced by the lease and the expected
position, so a runner that lost its lease can never insert a chunk twice. Job outcomes reach the lines and
the batch counters through core/store/batch_outcomes.py, called by finished.record_finished in the job
transition's own transaction: each job is counted exactly once. A round that fails backs the batch off
(`record_failure`: the count, the next attempt's time, the cause) until `claimable` offers it again; after too
many, `give_up` sets it to end `failed` from whatever open status it is in.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Integer, Row, bindparam, case, delete, func, or_, select, update
from sqlalchemy.orm import Bundle, Session

from conveyor.core.lifecycle import (
    BATCH_CANCELLED,
    BATCH_EXPIRED,
    BATCH_FAILED,
    CANCELLED,
    CANCELLING,
    COMPLETED,
    FINALIZING,
    IN_PROGRESS,
    LINE_FAILED,
    LINE_QUEUED,
    OPEN_BATCH_STATUSES,
    QUEUED,
    RUNNING,
    SCHEDULED,
    STOP_EXPIRED,
    STOP_FAILED,
    VALIDATING,
)
from conveyor.core.store import files, jobs, webhooks
from conveyor.core.store.final_status_effects import record_finished
from conveyor.core.store.paging import page_after_id, page_before_id
from conveyor.core.store.tables import Batch, BatchLine, Job


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
           meta: dict[str, Any] | None = None, run_at: datetime | None = None,
           request_count: int | None = None) -> Batch:
    """Inserts a validating batch and commits; a runner picks it up on its next round, or once `run_at` is
    reached (its runner's next_attempt_at), its completion window then counting from run_at. `request_count`:
    the lines of its input, when the caller wrote them (a Message Batch)."""
    since = run_at if run_at is not None and run_at > now else now
    batch = Batch(
        id=new_batch_id(), tenant_id=tenant_id, endpoint=endpoint, input_url=input_url,
        input_file_id=input_file_id, output_url=output_url, queue=queue,
        completion_window=f"{round(completion_window_s / 3600)}h", webhook=webhook, meta=meta,
        status=VALIDATING, total=0, request_count=request_count, completed=0, failed=0, cancelled=0,
        prompt_tokens=0, completion_tokens=0, read_line=1, read_offset=0, read_done=False, created_at=now,
        expires_at=since + timedelta(seconds=completion_window_s), updated_at=now,
        run_at=since if since > now else None, next_attempt_at=since if since > now else None,
    )
    session.add(batch)
    session.commit()
    return batch


def get(session: Session, batch_id: str, tenant_id: str | None = None) -> Batch | None:
    query = select(Batch).where(Batch.id == batch_id).execution_options(populate_existing=True)
    if tenant_id is not None:
        query = query.where(Batch.tenant_id == tenant_id)
    return session.execute(query).scalar_one_or_none()


def page(session: Session, tenant_id: str, *, limit: int, after: str | None = None, before: str | None = None,
         endpoint: str | None = None) -> list[Batch]:
    """Newest first; `after` is the last batch id of the previous page, `before` the first of the next one
    (the page just newer than it); an unknown id gives an empty page. `endpoint`: only the batches of that
    endpoint (the Message Batches list)."""
    query = select(Batch).where(Batch.tenant_id == tenant_id)
    if endpoint is not None:
        query = query.where(Batch.endpoint == endpoint)
    if before is not None:
        return page_before_id(session, query, Batch, tenant_id, limit=limit, before=before)
    return page_after_id(session, query, Batch, tenant_id, limit=limit, after=after)


def newest(session: Session, tenant_id: str | None, limit: int) -> list[Batch]:
    """The newest batches, of one tenant or (None) of every tenant (the console's admin view)."""
    query = select(Batch).order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit)
    if tenant_id is not None:
        query = query.where(Batch.tenant_id == tenant_id)
    return list(session.execute(query).scalars())


@dataclass(frozen=True)
class FailedLine:
    line: int
    custom_id: str | None
    code: str
    message: str


def failed_lines(session: Session, batch_id: str, limit: int) -> list[FailedLine]:
    """The batch's first `limit` failed lines, in line order, each with why: its own error (an invalid
    line) or its job's."""
    query = (select(BatchLine.line, BatchLine.custom_id, BatchLine.error, Job.error_code, Job.error_message)
             .outerjoin(Job, Job.id == BatchLine.job_id)
             .where(BatchLine.batch_id == batch_id, BatchLine.status == LINE_FAILED)
             .order_by(BatchLine.line).limit(limit))
    failed = []
    for line, custom_id, error, job_code, job_message in session.execute(query):
        code = (error or {}).get("code") or job_code or "unknown"
        message = (error or {}).get("message") or job_message or ""
        failed.append(FailedLine(line, custom_id or (error or {}).get("custom_id"), str(code), str(message)))
    return failed


# --- cancel and job outcomes ------------------------------------------------------------------------


def request_cancel(session: Session, batch_id: str, tenant_id: str, now: datetime) -> Batch | None:
    """validating|in_progress -> cancelling, cancelling the batch's queued and running jobs in the same
    transaction. Returns the batch as it now is, or None if the tenant has no such batch."""
    batch = get(session, batch_id, tenant_id)
    if batch is None:
        return None
    if batch.status in (VALIDATING, IN_PROGRESS):
        cancel_active_jobs(session, batch_id, now)
        not_started = batch.run_at is not None and batch.run_at > now and batch.failure_count == 0
        waiting = {"next_attempt_at": None} if not_started else {}  # its runner closes it now, not when due
        session.execute(
            update(Batch).where(Batch.id == batch_id, Batch.status.in_((VALIDATING, IN_PROGRESS)))
            .values(status=CANCELLING, cancelling_at=now, updated_at=now, **waiting)
            .execution_options(synchronize_session=False)
        )
    session.commit()
    return get(session, batch_id, tenant_id)


def cancel_active_jobs(session: Session, batch_id: str, now: datetime) -> list[str]:
    """scheduled|queued|running -> cancelled for the batch's jobs (scheduled: waiting out a retry's
    backoff); counted through record_finished. No commit."""
    active = select(BatchLine.job_id).where(BatchLine.batch_id == batch_id, BatchLine.status == LINE_QUEUED)
    open_statuses = (SCHEDULED, QUEUED, RUNNING)
    cancellable = jobs.lock_in_id_order(session, Job.id.in_(active), Job.status.in_(open_statuses))
    statement = (
        update(Job).where(Job.id.in_(cancellable), Job.status.in_(open_statuses))
        .values(status=CANCELLED, error_code="cancelled", error_message="the batch was cancelled",
                finished_at=now, updated_at=now)
        .returning(Job.id).execution_options(synchronize_session=False)
    )
    ids = list(session.execute(statement).scalars())
    if ids:
        record_finished(session, ids, CANCELLED, now)
    return ids


# --- the runner's lease -----------------------------------------------------------------------------


# Statements built once, with bound parameters; Core statements on the tables where no ORM object is wanted:
# a runner runs them several times a second, and building one cost more than running it.
_BATCHES, _LINES = Batch.__table__, BatchLine.__table__
_BATCH_ID = bindparam("b_batch_id", type_=Batch.id.type)
_OWNER = bindparam("b_owner", type_=Batch.lease_owner.type)
_NOW = bindparam("b_now", type_=Batch.updated_at.type)
# The lease is free, expired or already ours, and no backoff holds the batch back.
_FREE_AND_DUE = (or_(Batch.lease_owner.is_(None), Batch.lease_expires_at < _NOW, Batch.lease_owner == _OWNER)
                 & or_(Batch.next_attempt_at.is_(None), Batch.next_attempt_at <= _NOW))
_CLAIMABLE = (select(_BATCHES.c.id).where(_BATCHES.c.status.in_(OPEN_BATCH_STATUSES), _FREE_AND_DUE)
              .order_by(_BATCHES.c.created_at).limit(bindparam("b_limit", type_=Integer)))
_STARTING = Batch.status == VALIDATING
_TAKE_LEASE = (
    update(Batch)
    .where(Batch.id == _BATCH_ID, Batch.status.in_(OPEN_BATCH_STATUSES), _FREE_AND_DUE)
    .values(lease_owner=_OWNER, lease_expires_at=bindparam("b_expires", type_=Batch.lease_expires_at.type),
            updated_at=_NOW, status=case((_STARTING, IN_PROGRESS), else_=Batch.status),
            in_progress_at=case((_STARTING, _NOW), else_=Batch.in_progress_at))
    .returning(Batch)
    .execution_options(synchronize_session=False)
)


def claimable(session: Session, owner: str, now: datetime, limit: int) -> list[str]:
    """Open batches whose lease is free, expired or already ours and that are not backing off, oldest first
    (so batches waiting out a backoff never crowd out the others)."""
    return list(session.execute(_CLAIMABLE, {"b_owner": owner, "b_now": now, "b_limit": limit}).scalars())


def lease(session: Session, batch_id: str, owner: str, now: datetime, lease_s: float) -> Batch | None:
    """Takes or renews the lease (free, expired, or ours; not backing off), validating -> in_progress on
    first take, in one UPDATE; the batch as it is now, or None when the lease is not ours. Commits."""
    params = {"b_batch_id": batch_id, "b_owner": owner, "b_now": now,
              "b_expires": now + timedelta(seconds=lease_s)}
    batch = session.execute(_TAKE_LEASE, params).scalar_one_or_none()
    session.commit()
    return batch


def take_lease(session: Session, batch_id: str, owner: str, now: datetime, lease_s: float) -> bool:
    """`lease`, for callers that only need to know it is theirs."""
    return lease(session, batch_id, owner, now, lease_s) is not None


def release_lease(session: Session, batch_id: str, owner: str) -> None:
    session.execute(
        update(Batch).where(Batch.id == batch_id, Batch.lease_owner == owner)
        .values(lease_owner=None, lease_expires_at=None).execution_options(synchronize_session=False)
    )
    session.commit()


# --- failed rounds ----------------------------------------------------------------------------------


def record_failure(session: Session, batch_id: str, owner: str, now: datetime, *, failures: int,
                   retry_at: datetime, cause: str) -> bool:
    """Stores a failed round of a batch this runner holds: `failures` in a row, no new round before
    `retry_at`. The lease is released, so whichever runner is free then, in any process, takes it. False
    when the lease was lost. Commits."""
    result = session.execute(
        update(Batch).where(Batch.id == batch_id, Batch.lease_owner == owner,
                            Batch.status.in_(OPEN_BATCH_STATUSES))
        .values(failure_count=failures, next_attempt_at=retry_at, last_failure=cause, lease_owner=None,
                lease_expires_at=None, updated_at=now)
        .execution_options(synchronize_session=False)
    )
    session.commit()
    return result.rowcount == 1  # type: ignore[attr-defined,no-any-return]


def clear_failures(session: Session, batch_id: str) -> None:
    """A round went through: the failures before it no longer count. Commits."""
    session.execute(
        update(Batch).where(Batch.id == batch_id, Batch.failure_count > 0)
        .values(failure_count=0, next_attempt_at=None, last_failure=None)
        .execution_options(synchronize_session=False)
    )
    session.commit()


def give_up(session: Session, batch_id: str, owner: str, errors: list[dict[str, Any]],
            now: datetime) -> Batch | None:
    """Any open batch this runner holds is set to end `failed` with `errors`: its active jobs are cancelled,
    validating|in_progress -> finalizing, finalizing and cancelling stay until `finish` closes them. None
    (nothing changed) when the lease was lost. Commits."""
    cancel_active_jobs(session, batch_id, now)
    reading = Batch.status.in_((VALIDATING, IN_PROGRESS))
    result = session.execute(
        update(Batch).where(Batch.id == batch_id, Batch.lease_owner == owner,
                            Batch.status.in_(OPEN_BATCH_STATUSES))
        .values(status=case((reading, FINALIZING), else_=Batch.status),
                finalizing_at=case((reading, now), else_=Batch.finalizing_at),
                stop_reason=STOP_FAILED, errors=errors, next_attempt_at=None, updated_at=now)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        session.rollback()
        return None
    session.commit()
    return get(session, batch_id)


# --- reading the input ------------------------------------------------------------------------------


_ACTIVE_LINES = (select(func.count()).select_from(_LINES)
                 .where(_LINES.c.batch_id == _BATCH_ID, _LINES.c.status == LINE_QUEUED))


def active_lines(session: Session, batch_id: str) -> int:
    """The batch's lines queued or running (their job not final yet)."""
    return int(session.execute(_ACTIVE_LINES, {"b_batch_id": batch_id}).scalar_one())


def seen_custom_ids(session: Session, batch_id: str) -> set[str]:
    query = select(BatchLine.custom_id).where(BatchLine.batch_id == batch_id,
                                              BatchLine.custom_id.is_not(None))
    return {custom_id for (custom_id,) in session.execute(query)}


def queued_line(batch_id: str, line: int, custom_id: str, job_id: str) -> dict[str, Any]:
    """The batch_lines row of a valid line, its job queued (for commit_chunk)."""
    return {"batch_id": batch_id, "line": line, "custom_id": custom_id, "status": LINE_QUEUED,
            "job_id": job_id}


def failed_line(batch_id: str, line: int, custom_id: str | None, error: dict[str, Any]) -> dict[str, Any]:
    """The batch_lines row of an invalid line (for commit_chunk): failed with `error`, no job."""
    return {"batch_id": batch_id, "line": line, "custom_id": custom_id, "status": LINE_FAILED, "error": error}


def commit_chunk(session: Session, batch_id: str, owner: str, position: ChunkPosition,
                 lines: list[dict[str, Any]], new_jobs: list[dict[str, Any]], now: datetime) -> bool:
    """Inserts the chunk's lines (rows of queued_line / failed_line) and jobs (rows of jobs.build_row) and
    advances the read position, all or nothing: one UPDATE and an executemany per kind of row. False (rolled
    back) when the lease is no longer ours, the batch stopped running, or another runner got here first."""
    failed = [line for line in lines if line["status"] == LINE_FAILED]
    queued = [line for line in lines if line["status"] != LINE_FAILED]
    result = session.execute(_ADVANCE_READING, {
        "b_batch_id": batch_id, "b_owner": owner, "b_start_line": position.start_line,
        "b_next_line": position.next_line, "b_next_offset": position.next_offset, "b_done": position.done,
        "b_lines": len(lines), "b_failed": len(failed), "b_now": now})
    if result.rowcount != 1:  # type: ignore[attr-defined]
        session.rollback()
        return False
    jobs.insert_rows(session, new_jobs)  # before the lines that name them
    # Two statements: an executemany takes one set of columns, and a queued line's error stays SQL NULL.
    for rows in (queued, failed):
        if rows:
            session.execute(_INSERT_LINE, rows)
    session.commit()
    return True


_ADVANCE_READING = (
    update(_BATCHES)
    .where(_BATCHES.c.id == _BATCH_ID, _BATCHES.c.lease_owner == _OWNER, _BATCHES.c.status == IN_PROGRESS,
           _BATCHES.c.read_line == bindparam("b_start_line", type_=Integer))
    .values(read_line=bindparam("b_next_line", type_=Integer),
            read_offset=bindparam("b_next_offset", type_=_BATCHES.c.read_offset.type),
            read_done=bindparam("b_done", type_=_BATCHES.c.read_done.type),
            total=_BATCHES.c.total + bindparam("b_lines", type_=Integer),
            failed=_BATCHES.c.failed + bindparam("b_failed", type_=Integer), updated_at=_NOW)
)
_INSERT_LINE = _LINES.insert()


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


# What an output line is written from: the line's columns, and its job's but for the request (messages,
# inputs: possibly large, and already answered), read as plain rows: no ORM object per line.
_LINE_FIELDS = Bundle("line", BatchLine.line, BatchLine.custom_id, BatchLine.status, BatchLine.error)
_JOB_FIELDS = Bundle(
    "job", Job.id, Job.status, Job.queue, Job.params, Job.meta, Job.chat, Job.prompt, Job.result_text,
    Job.finish_reason, Job.prompt_tokens, Job.completion_tokens, Job.cached_tokens, Job.draft_tokens,
    Job.accepted_draft_tokens, Job.logprobs, Job.choices, Job.prompt_logprobs, Job.embeddings,
    Job.error_code, Job.error_message, Job.finished_at)
_LINES_IN_ORDER = (select(_LINE_FIELDS, _JOB_FIELDS).outerjoin(Job, Job.id == BatchLine.job_id)
                   .where(BatchLine.batch_id == _BATCH_ID).order_by(BatchLine.line))


def lines_in_order(session: Session, batch_id: str, yield_per: int = 500,
                   ) -> Iterator[tuple[Row[Any], Row[Any] | None]]:
    """Every line of the batch by line number, with its job (None for an invalid line), as rows with the
    attributes of BatchLine and Job that outputs are written from; streamed, never all in memory."""
    rows = session.execute(_LINES_IN_ORDER.execution_options(yield_per=yield_per), {"b_batch_id": batch_id})
    for line, job in rows:
        yield line, job if job.id is not None else None


def final_status(batch: Batch) -> str:
    """A batch given up on is `failed` even while cancelling: its cancel could not be carried out."""
    if batch.stop_reason == STOP_FAILED:
        return BATCH_FAILED
    if batch.status == CANCELLING:
        return BATCH_CANCELLED
    return BATCH_EXPIRED if batch.stop_reason == STOP_EXPIRED else COMPLETED


def finish(session: Session, batch_id: str, owner: str, now: datetime, *, status: str, unread: int,
           outputs: dict[str, str] | None, output_file_id: str | None, error_file_id: str | None,
           errors: list[dict[str, Any]] | None = None) -> Batch | None:
    """finalizing|cancelling -> its final status, with the outputs written and the lines never read counted
    as cancelled; `errors`, when given, replace the batch's. No commit: the caller adds the files and the
    webhook event to this transaction. None when the lease was lost."""
    extra: dict[str, Any] = {} if errors is None else {"errors": errors}
    result = session.execute(
        update(Batch).where(Batch.id == batch_id, Batch.lease_owner == owner,
                            Batch.status.in_((FINALIZING, CANCELLING)))
        .values(status=status, total=Batch.total + unread, cancelled=Batch.cancelled + unread,
                outputs=outputs, output_file_id=output_file_id, error_file_id=error_file_id,
                finished_at=now, updated_at=now, lease_owner=None, lease_expires_at=None, read_done=True,
                **extra)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        session.rollback()
        return None
    return get(session, batch_id)


# --- deleting ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchDeletionStep:
    """One transaction of deleting a batch: `status` None when there is no such batch (or, with
    skip_locked, another transaction holds it); an open status means nothing was deleted; else `done` says
    whether the batch row itself went, and `blob_urls` are its output files' blobs to remove."""

    status: str | None
    done: bool = False
    blob_urls: list[str] = field(default_factory=list)


def delete_step(session: Session, batch_id: str, tenant_id: str | None, chunk_rows: int, *,
                skip_locked: bool = False) -> BatchDeletionStep:
    """Deletes up to `chunk_rows` of an ended batch's lines with their jobs (and those jobs' webhook
    deliveries); once none are left, its output and error files, its own deliveries and the batch row.
    Holds the batch row's lock for the transaction, so two deleters (the API and purges in several
    workers) never work on one batch at once. Commits. Call again until `done`."""
    query = select(Batch.status, Batch.tenant_id, Batch.output_file_id, Batch.error_file_id).where(
        Batch.id == batch_id)
    if tenant_id is not None:
        query = query.where(Batch.tenant_id == tenant_id)
    row = session.execute(query.with_for_update(skip_locked=skip_locked)).first()
    if row is None or row.status in OPEN_BATCH_STATUSES:
        session.rollback()
        return BatchDeletionStep(row.status if row is not None else None)
    lines = session.execute(
        select(BatchLine.line, BatchLine.job_id).where(BatchLine.batch_id == batch_id).limit(chunk_rows)
    ).all()
    if lines:
        jobs.delete_rows(session, row.tenant_id, [job_id for _, job_id in lines if job_id is not None])
        session.execute(delete(BatchLine).where(BatchLine.batch_id == batch_id,
                                                BatchLine.line.in_([line for line, _ in lines])))
        session.commit()
        return BatchDeletionStep(row.status)
    urls = files.delete_rows(session, [f for f in (row.output_file_id, row.error_file_id) if f is not None])
    webhooks.delete_for_subjects(session, row.tenant_id, "batch", [batch_id])
    deleted = session.execute(delete(Batch).where(Batch.id == batch_id)).rowcount  # type: ignore[attr-defined]
    session.commit()
    if deleted != 1:  # another deleter got here first (SQLite has no row locks to keep it out)
        return BatchDeletionStep(None)
    return BatchDeletionStep(row.status, done=True, blob_urls=urls)
