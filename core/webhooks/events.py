"""Webhook event types, the event body, and subscription filters (`job.*`, `*`, or exact types).

`job.started` (a worker claimed the job: each attempt sends one) is opt-in: only a filter naming it exactly
receives it, so `*`, `job.*` and no filter at all keep meaning the final events they meant before it existed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

JOB_STARTED = "job.started"
JOB_EVENTS = ("job.succeeded", "job.failed", "job.cancelled", "job.expired", JOB_STARTED)
BATCH_EVENTS = ("batch.completed", "batch.failed", "batch.cancelled", "batch.expired")
# A job submitted through POST /v1/responses ends with OpenAI's event of its response instead of job.*.
RESPONSE_EVENTS = ("response.completed", "response.incomplete", "response.failed", "response.cancelled")
EVENT_TYPES: tuple[str, ...] = JOB_EVENTS + BATCH_EVENTS + RESPONSE_EVENTS
OPT_IN_EVENTS = (JOB_STARTED,)  # sent only where a filter names them exactly


def build_event(event_type: str, data: dict[str, Any], occurred_at: datetime) -> dict[str, Any]:
    """The event as delivered: `data` is the job or batch exactly as its `GET` returns it."""
    if event_type not in EVENT_TYPES:
        raise ValueError(f"event type {event_type!r} is not one of {', '.join(EVENT_TYPES)}")
    if occurred_at.tzinfo is None:
        raise ValueError("occurred_at must be timezone-aware")
    timestamp = occurred_at.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")
    return {"type": event_type, "timestamp": timestamp, "data": data}


def encode_event(event: dict[str, Any]) -> bytes:
    """Compact JSON, the exact bytes that are signed and sent."""
    return json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode()


def validate_filter(patterns: Sequence[str]) -> list[str]:
    """Check a subscription's event filter: exact types, `<group>.*` (e.g. `job.*`) or `*`."""
    groups = {event_type.split(".")[0] for event_type in EVENT_TYPES}
    for pattern in patterns:
        is_group = pattern.endswith(".*") and pattern[:-2] in groups
        if pattern != "*" and pattern not in EVENT_TYPES and not is_group:
            raise ValueError(f"event filter {pattern!r} is not an event type, '<group>.*' or '*'")
    return list(patterns)


def matches(patterns: Sequence[str], event_type: str) -> bool:
    """Whether a subscription with these filter patterns wants this event; an empty filter wants all but the
    opt-in events."""
    if event_type in OPT_IN_EVENTS:
        return event_type in patterns
    if not patterns:
        return True
    return any(_matches_one(pattern, event_type) for pattern in patterns)


def _matches_one(pattern: str, event_type: str) -> bool:
    if pattern == "*":
        return True
    if pattern.endswith(".*"):
        return event_type.startswith(pattern[:-1])
    return pattern == event_type
