"""Queries behind /readyz (live workers come from api/store/workers.py)."""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.orm import Session


def ping(session: Session) -> None:
    session.execute(text("SELECT 1"))
