"""The time window of a trace export, as `--since` / `--until` (and the admin route's `since` / `until`) give
it: a duration ago (`90s`, `30m`, `1h`, `2d`) or an ISO 8601 time.

`since` is required and `until` defaults to now; until must come after since. A time without an offset is
read as UTC."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")
UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
MAX_AGO = timedelta(days=3650)  # beyond any retention: a typo (`1000000d`) is refused, not an overflow


def window_bounds(since: str, until: str | None, now: datetime) -> tuple[datetime, datetime]:
    """(since, until) as aware UTC times. ValueError "<field>: <reason>" for a value that is neither form,
    or for until not after since."""
    start = parse_time(since, "since", now)
    end = now if until is None else parse_time(until, "until", now)
    if end <= start:
        raise ValueError(f"until: {end.isoformat()} is not after since {start.isoformat()}")
    return start, end


def parse_time(value: str, field: str, now: datetime) -> datetime:
    """A duration ago (`1h`: now - 1 hour) or an ISO 8601 time; ValueError naming `field` otherwise."""
    assert now.tzinfo is not None, "now must be timezone-aware"
    duration = DURATION.match(value)
    if duration is not None:
        ago = timedelta(seconds=float(duration.group(1)) * UNIT_S[duration.group(2)])
        if ago > MAX_AGO:
            raise ValueError(f"{field}: {value!r} reaches back more than {MAX_AGO.days} days")
        return now - ago
    try:
        moment = datetime.fromisoformat(value.strip())
    except ValueError:
        raise ValueError(f"{field}: {value!r} is neither a duration (90s, 30m, 1h, 2d: that long ago) nor an "
                         "ISO 8601 time (2026-12-06T10:00:00Z)") from None
    return (moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)).astimezone(
        timezone.utc)
