"""The webhook retry schedule: pure functions of the attempt number, a random source and `now`.

Attempt 1 is sent as soon as the event happens. After failed attempt n (n = 1..10) attempt n+1 is due after
RETRY_DELAYS[n-1], each delay jittered by a uniform factor in [0.9, 1.1]:

    5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h, 14 h, 14 h, 16 h

11 attempts in all; the delays add up to 257,705 s = 2 d 23 h 35 min 5 s (2.68 to 3.28 days with jitter).
After attempt 11 the delivery is exhausted. A `Retry-After` from the receiver (seconds or an HTTP date),
capped at MAX_RETRY_AFTER, replaces the scheduled delay when it is longer; it never adds attempts.
"""

from __future__ import annotations

import random
from datetime import datetime, timedelta
from email.utils import parsedate_to_datetime

RETRY_DELAYS: tuple[timedelta, ...] = (
    timedelta(seconds=5),
    timedelta(minutes=5),
    timedelta(minutes=30),
    timedelta(hours=2),
    timedelta(hours=5),
    timedelta(hours=10),
    timedelta(hours=10),
    timedelta(hours=14),
    timedelta(hours=14),
    timedelta(hours=16),
)
MAX_ATTEMPTS = len(RETRY_DELAYS) + 1
JITTER = 0.1
MAX_RETRY_AFTER = timedelta(hours=24)


def retry_delay(attempt: int, rng: random.Random) -> timedelta | None:
    """The jittered wait after failed attempt `attempt` (1-based), or None when no attempt is left."""
    if attempt < 1:
        raise ValueError(f"attempt must be at least 1, got {attempt}")
    if attempt >= MAX_ATTEMPTS:
        return None
    return RETRY_DELAYS[attempt - 1] * rng.uniform(1 - JITTER, 1 + JITTER)


def parse_retry_after(value: str | None, now: datetime) -> timedelta | None:
    """A `Retry-After` header (delay seconds or HTTP date) as a wait from `now`; None when absent or bad."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    if text.isdigit():
        return timedelta(seconds=int(text))
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:   # an HTTP date is always GMT
        return None
    return max(when - now, timedelta(0))


def next_attempt_at(attempt: int, *, now: datetime, rng: random.Random,
                    retry_after: timedelta | None = None) -> datetime | None:
    """When to send attempt `attempt + 1`, or None when the schedule is exhausted."""
    delay = retry_delay(attempt, rng)
    if delay is None:
        return None
    if retry_after is not None:
        delay = max(delay, min(retry_after, MAX_RETRY_AFTER))
    return now + delay
