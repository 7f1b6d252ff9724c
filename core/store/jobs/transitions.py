"""The one conditional UPDATE behind every status change, and the row locks a change of several rows
takes first (in id order) or skips (a sweep must not wait on one row)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Select, literal_column, select, update
from sqlalchemy.orm import Session

from conveyor.core.lifecycle import EXPIRED, JOB_STATUSES, JOB_TRANSITIONS, TERMINAL_STATUSES
from conveyor.core.store.final_status_effects import record_finished
from conveyor.core.store.tables import Job


def status_is(status: str) -> ColumnElement[bool]:
    """`status = '<status>'` with the status written into the SQL, not bound: PostgreSQL may plan a bound
    parameter generically, and a generic plan cannot use the partial indexes (tables.PARTIAL_INDEXES), whose
    predicates name the status."""
    assert status in JOB_STATUSES, status
    return Job.status == literal_column(f"'{status}'")


def lock_in_id_order(session: Session, *conditions: ColumnElement[bool], limit: int | None = None,
                     ) -> list[str]:
    """Locks the job rows matching `conditions` (the first `limit` of them) in id order and returns their
    ids (PostgreSQL: SELECT ... ORDER BY id FOR UPDATE; SQLite has one writer). Every transaction that
    changes several job rows and waits for their locks takes them this way first: two that locked in their
    own scan orders could each hold a row the other waits on, a deadlock PostgreSQL breaks by failing one of
    them (a batch cancel against a claim did). Sweeps that must not wait use `unlocked` instead."""
    query = select(Job.id).where(*conditions).order_by(Job.id).limit(limit).with_for_update()
    return list(session.execute(query).scalars())


def unlocked(*conditions: ColumnElement[bool]) -> Select[tuple[str]]:
    """Ids of the jobs matching `conditions` that no open transaction is changing (PostgreSQL: FOR UPDATE
    SKIP LOCKED; SQLite has one writer and ignores it). A sweep over many rows must not wait on one row: a
    worker frozen (SIGSTOP, a stalled VM) in the middle of a transaction holds its rows' locks until its
    session ends, and a plain UPDATE waiting on them would stall the whole fleet's reconcile with it. The
    skipped rows are swept in a later round, once that transaction has ended (the worker resumed, or its
    connection died)."""
    return select(Job.id).where(*conditions).with_for_update(skip_locked=True)


def expired_values(now: datetime) -> dict[str, Any]:
    return dict(status=EXPIRED, error_code="expired", error_message="ttl passed before the job started",
                finished_at=now, updated_at=now)


def transition(
    session: Session, job_id: str, from_statuses: tuple[str, ...], condition: ColumnElement[bool] | None,
    **values: Any,
) -> bool:
    """One conditional UPDATE and its follow-on effects, committed; says whether a row changed."""
    applied = conditional_update(session, job_id, from_statuses, condition, **values)
    if applied and values.get("status") in TERMINAL_STATUSES:
        record_finished(session, [job_id], values["status"], values["finished_at"])
    session.commit()
    return applied


def conditional_update(
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
