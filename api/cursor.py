"""Opaque pagination cursors: the (created_at, id) of the last job of a page, base64url-encoded."""

from __future__ import annotations

import base64
import json
from datetime import datetime

from conveyor.core.store.tables import Job


def encode(job: Job) -> str:
    raw = json.dumps([job.created_at.isoformat(), job.id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode(cursor: str) -> tuple[datetime, str]:
    """Raises ValueError for anything this module did not produce."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created_at, job_id = json.loads(raw)
        when = datetime.fromisoformat(created_at)
    except Exception as exc:
        raise ValueError("cursor: not a cursor returned by this API") from exc
    if when.tzinfo is None or not isinstance(job_id, str):
        raise ValueError("cursor: not a cursor returned by this API")
    return when, job_id
