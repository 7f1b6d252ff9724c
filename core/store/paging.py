"""Keyset pagination, newest first by (created_at, id): stable under inserts, no OFFSET scans."""

from __future__ import annotations

from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import Select, and_, or_, select
from sqlalchemy.orm import Session

RowT = TypeVar("RowT", bound=tuple[Any, ...])


def newest_first(query: Select[RowT], model: Any, *, limit: int,
                 before: tuple[datetime, str] | None = None) -> Select[RowT]:
    """`query` newest first, after `before`: the (created_at, id) of the previous page's last row."""
    if before is not None:
        created_at, row_id = before
        same_time_lower_id = and_(model.created_at == created_at, model.id < row_id)
        query = query.where(or_(model.created_at < created_at, same_time_lower_id))
    return query.order_by(model.created_at.desc(), model.id.desc()).limit(limit)


def page_after_id(session: Session, query: Select[Any], model: Any, tenant_id: str, *, limit: int,
                  after: str | None) -> list[Any]:
    """`query`'s rows newest first, after the tenant's row with id `after` (an OpenAI-style list cursor); an
    id the tenant does not have gives an empty page."""
    before = None
    if after is not None:
        owned = select(model).where(model.id == after, model.tenant_id == tenant_id)
        last = session.execute(owned).scalar_one_or_none()
        if last is None:
            return []
        before = (last.created_at, last.id)
    return list(session.execute(newest_first(query, model, limit=limit, before=before)).scalars())
