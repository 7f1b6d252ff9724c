"""A job's earlier attempts: what each one ended as, kept in `jobs.history` when the job runs again (a retry
on request, or the retry policy's backoff), so running a job again never hides how it went before."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from conveyor.core.store.tables import Job


def outcome_entry(job: Job, *, status: str | None = None, error_code: str | None = None,
                  error_message: str | None = None, finished_at: datetime | None = None) -> dict[str, Any]:
    """The job's current attempt as a history entry (JSON-ready); the keywords override what the row says
    (a failure being written now is not in the row yet)."""
    code = error_code if error_code is not None else job.error_code
    message = error_message if error_message is not None else job.error_message
    ended = finished_at if finished_at is not None else job.finished_at
    return {
        "attempt": job.attempts, "status": status or job.status,
        "error": {"code": code, "message": message} if code else None,
        "started_at": _iso(job.started_at), "finished_at": _iso(ended),
        "completion_tokens": job.completion_tokens,
    }


def with_entry(job: Job, entry: dict[str, Any]) -> list[dict[str, Any]]:
    return [*(job.history or []), entry]


def _iso(at: datetime | None) -> str | None:
    return at.isoformat() if at is not None else None
