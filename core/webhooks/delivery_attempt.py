"""The record of one delivery attempt, shared by the worker's sender and the store that keeps it."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

Outcome = Literal["delivered", "retry", "disabled", "failed"]


@dataclass(frozen=True)
class AttemptResult:
    event_id: str                     # the webhook-id, the same for every attempt of one event
    attempt: int
    attempted_at: datetime
    outcome: Outcome
    status_code: int | None
    duration_s: float
    error: str | None
    response_excerpt: str | None
    next_attempt_at: datetime | None
