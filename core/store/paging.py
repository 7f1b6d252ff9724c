"""Keyset pagination, newest first by (created_at, id): stable under inserts, no OFFSET scans."""

from __future__ import annotations

from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import Select, and_, or_

RowT = TypeVar("RowT", bound=tuple[Any, ...])


def newest_first(query: Select[RowT], model: Any, *, limit: int,
                 before: tuple[datetime, str] | None = None) -> Select[RowT]:
    """`query` newest first, after `before`: the (created_at, id) of the previous page's last row."""
    if before is not None:
        created_at, row_id = before
        same_time_lower_id = and_(model.created_at == created_at, model.id < row_id)
        query = query.where(or_(model.created_at < created_at, same_time_lower_id))
    return query.order_by(model.created_at.desc(), model.id.desc()).limit(limit)
