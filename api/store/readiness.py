"""Queries behind /readyz."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from api.store.models import Worker


def ping(session: Session) -> None:
    session.execute(text("SELECT 1"))


def live_workers(session: Session, seen_since: datetime) -> int:
    query = select(func.count()).select_from(Worker).where(
        Worker.stopped_at.is_(None), Worker.last_seen_at >= seen_since
    )
    return int(session.execute(query).scalar_one())
