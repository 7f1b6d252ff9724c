"""The batch side of jobs reaching a final status: their lines' statuses and their batches' counters.

Called by core/store/finished.record_finished inside the job transition's own transaction, only for the jobs
whose transition applied, so each batch job is counted exactly once.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from conveyor.core.lifecycle import CANCELLED, LINE_OUTCOME, LINE_QUEUED, SUCCEEDED
from conveyor.core.store.tables import Batch, BatchLine, Job


def record_outcomes(session: Session, job_ids: list[str], status: str, now: datetime) -> None:
    """The batch side of a job reaching `status`: its line's status and its batch's counters. Runs inside the
    job transition's transaction; lines already past `queued` are left alone, so nothing counts twice."""
    statement = (
        update(BatchLine).where(BatchLine.job_id.in_(job_ids), BatchLine.status == LINE_QUEUED)
        .values(status=LINE_OUTCOME[status])
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
