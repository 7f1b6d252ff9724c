"""What else changes, in the same transaction, when jobs reach a final status.

Every transition into succeeded, failed, cancelled or expired calls `record_finished` before its commit,
only for the rows it actually changed, so whatever reacts here (webhook events, batch counters) happens
exactly once per job and never for a transition that lost a race.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session

from core.store import batch_outcomes, outcome_counts, webhook_events


def record_finished(session: Session, job_ids: list[str], status: str, now: datetime) -> None:
    """Runs inside the transition's transaction; each feature reacting to finished jobs adds its call here."""
    webhook_events.enqueue_job_events(session, job_ids, status, now)
    batch_outcomes.record_outcomes(session, job_ids, status, now)
    outcome_counts.record_finished_jobs(session, job_ids, status)  # the API's job metrics
