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
        before = _position(session, model, tenant_id, after)
        if before is None:
            return []
    return list(session.execute(newest_first(query, model, limit=limit, before=before)).scalars())


def page_before_id(session: Session, query: Select[Any], model: Any, tenant_id: str, *, limit: int,
                   before: str) -> list[Any]:
    """The `limit` rows of `query` just newer than the tenant's row with id `before` (Anthropic's `before_id`:
    the page before it in a newest-first list), newest first; an id the tenant does not have gives an empty
    page."""
    position = _position(session, model, tenant_id, before)
    if position is None:
        return []
    created_at, row_id = position
    newer = or_(model.created_at > created_at, and_(model.created_at == created_at, model.id > row_id))
    nearest = query.where(newer).order_by(model.created_at.asc(), model.id.asc()).limit(limit)
    return list(session.execute(nearest).scalars())[::-1]


def _position(session: Session, model: Any, tenant_id: str, row_id: str) -> tuple[datetime, str] | None:
    """The (created_at, id) of the tenant's row `row_id`, where a page starts from; None if it has none."""
    owned = select(model).where(model.id == row_id, model.tenant_id == tenant_id)
    row = session.execute(owned).scalar_one_or_none()
    return None if row is None else (row.created_at, row.id)
