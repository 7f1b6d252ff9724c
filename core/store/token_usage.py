"""Tokens per minute, counted from the store so the limit holds across API processes.

A job counts in the minute after it was submitted (its created_at), for:
- queued or running: its prompt tokens + n x its max_tokens (a reservation: what its n choices may use);
- final, having started: its prompt tokens + the tokens it generated (the reservation corrected);
- final without ever starting (cancelled or expired while queued): nothing.
Batch lines count too (their prompt tokens are known once they ran). The sum is one range read of the
tenant's jobs created in the last minute (the (tenant_id, created_at) index).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Integer, case, cast, func, select
from sqlalchemy.orm import Session

from conveyor.core.lifecycle import QUEUED, RUNNING
from conveyor.core.protocol.job_params import DEFAULT_MAX_TOKENS
from conveyor.core.store.tables import Job

WINDOW = timedelta(seconds=60)


@dataclass(frozen=True)
class WindowUse:
    """Per job in the window, oldest first: (created_at, tokens)."""

    entries: list[tuple[datetime, int]]

    @property
    def total(self) -> int:
        return sum(tokens for _, tokens in self.entries)

    def seconds_until_room(self, needed: int, limit: int, now: datetime) -> float:
        """How long until `needed` more tokens fit under `limit`, as the oldest jobs leave the window."""
        excess = self.total + needed - limit
        for created_at, tokens in self.entries:
            if excess <= 0:
                break
            excess -= tokens
            wait = (created_at + WINDOW - now).total_seconds()
            if excess <= 0:
                return max(wait, 0.0)
        return 0.0 if excess <= 0 else WINDOW.total_seconds()


def counted_tokens() -> object:
    """The tokens one job counts for (the module docstring's rule), as a SQL expression."""
    max_tokens = func.coalesce(cast(Job.params["max_tokens"].as_integer(), Integer), DEFAULT_MAX_TOKENS)
    reserved = max_tokens * func.coalesce(cast(Job.params["n"].as_integer(), Integer), 1)
    used = func.coalesce(Job.completion_tokens, 0)
    return case(
        (Job.status.in_((QUEUED, RUNNING)), func.coalesce(Job.prompt_tokens, 0) + reserved),
        (Job.started_at.is_(None), 0),
        else_=func.coalesce(Job.prompt_tokens, 0) + used,
    )


def window_use(session: Session, tenant_id: str, now: datetime) -> WindowUse:
    query = (
        select(Job.created_at, counted_tokens())
        .where(Job.tenant_id == tenant_id, Job.created_at > now - WINDOW)
        .order_by(Job.created_at)
    )
    return WindowUse([(created_at, int(tokens)) for created_at, tokens in session.execute(query)])


def tokens_used(session: Session, tenant_id: str, now: datetime) -> int:
    query = select(func.coalesce(func.sum(counted_tokens()), 0)).where(
        Job.tenant_id == tenant_id, Job.created_at > now - WINDOW)
    return int(session.execute(query).scalar_one())
