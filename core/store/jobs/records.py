"""Jobs read as plain rows for answering clients: the columns under Job's attribute names (`meta`, not the
column's `metadata`), without building ORM objects. A long poll's group read (api/job_reads.py) spends most
of its time loading rows, and an ORM object per row (identity map, instrumented state) costs several times
what a Core row does; the views read attributes only (core/views/public.py JobPublic.from_row). The request's
own inputs (a prompt, messages, embedding inputs: up to megabytes) are not read: no answer shows them."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Row, bindparam, select
from sqlalchemy.orm import Session

from conveyor.core.store.tables import Job

JobRecord = Row[Any]  # a job as `records` reads it: Job's attributes, but UNREAD
_TABLE = Job.__table__
UNREAD = frozenset({"prompt", "messages", "inputs"})
_COLUMNS = [_TABLE.c[attribute.columns[0].name].label(attribute.key)
            for attribute in Job.__mapper__.column_attrs if attribute.key not in UNREAD]
_BY_IDS = select(*_COLUMNS).where(_TABLE.c.id.in_(bindparam("b_ids", expanding=True)))


def records(session: Session, job_ids: list[str]) -> list[JobRecord]:
    """The jobs of these ids that exist, as rows with Job's attributes but UNREAD, in any order."""
    return list(session.connection().execute(_BY_IDS, {"b_ids": job_ids}))
