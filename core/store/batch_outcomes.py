"""The batch side of jobs reaching a final status: their lines' statuses and their batches' counters.

Called by core/store/finished.record_finished inside the job transition's own transaction, only for the jobs
whose transition applied, so each batch job is counted exactly once. Two statements, built once (Core, on
the tables): the lines' UPDATE, which returns the lines it moved, and per batch one UPDATE of its counters,
whose token totals are summed from the jobs' rows in the same statement.
"""

from __future__ import annotations

import functools
from datetime import datetime

from sqlalchemy import Integer, Update, bindparam, func, select, update
from sqlalchemy.orm import Session

from conveyor.core.lifecycle import CANCELLED, LINE_OUTCOME, LINE_QUEUED, SUCCEEDED
from conveyor.core.store.tables import Batch, BatchLine, Job

_LINES, _BATCHES, _JOBS = BatchLine.__table__, Batch.__table__, Job.__table__
_SETTLE_LINES = (
    update(_LINES)
    .where(_LINES.c.job_id.in_(bindparam("b_job_ids", expanding=True)), _LINES.c.status == LINE_QUEUED)
    .values(status=bindparam("b_line_status", type_=_LINES.c.status.type))
    .returning(_LINES.c.batch_id, _LINES.c.job_id)
)


def record_outcomes(session: Session, job_ids: list[str], status: str, now: datetime) -> None:
    """The batch side of a job reaching `status`: its line's status and its batch's counters. Runs inside the
    job transition's transaction; lines already past `queued` are left alone, so nothing counts twice."""
    rows = session.execute(_SETTLE_LINES, {"b_job_ids": job_ids, "b_line_status": LINE_OUTCOME[status]}).all()
    if not rows:
        return
    counter = {SUCCEEDED: "completed", CANCELLED: "cancelled"}.get(status, "failed")
    statement = _count_statement(counter, with_tokens=status == SUCCEEDED)
    jobs_of: dict[str, list[str]] = {}
    for batch_id, job_id in rows:
        jobs_of.setdefault(batch_id, []).append(job_id)
    for batch_id in sorted(jobs_of):  # a fixed lock order
        counted = jobs_of[batch_id]
        session.execute(statement, {"b_batch_id": batch_id, "b_n": len(counted), "b_counted": counted,
                                    "b_now": now})


@functools.cache
def _count_statement(counter: str, *, with_tokens: bool) -> Update:
    """`counter` + b_n for batch b_batch_id; with_tokens: its token totals + those of the jobs b_counted."""
    values = {counter: _BATCHES.c[counter] + bindparam("b_n", type_=Integer),
              "updated_at": bindparam("b_now", type_=_BATCHES.c.updated_at.type)}
    if with_tokens:
        counted = bindparam("b_counted", expanding=True)
        for name in ("prompt_tokens", "completion_tokens"):
            total = select(func.coalesce(func.sum(_JOBS.c[name]), 0)).where(_JOBS.c.id.in_(counted))
            values[name] = _BATCHES.c[name] + total.scalar_subquery()
    return update(_BATCHES).where(_BATCHES.c.id == bindparam("b_batch_id", type_=_BATCHES.c.id.type)).values(
        **values)
