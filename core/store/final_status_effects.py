"""What else changes, in the same transaction, when jobs reach a final status.

Every transition into succeeded, failed, cancelled or expired calls `record_finished` before its commit,
only for the rows it actually changed, so whatever reacts here (webhook events, batch counters) happens
exactly once per job and never for a transition that lost a race.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from conveyor.core.store import batch_outcomes, outcome_counts, webhook_events
from conveyor.core.store.tables import Job

_JOBS = Job.__table__
# What the effects read of each finished job, in one query for all of them (on the table: no ORM entities).
FINISHED_COLUMNS = (*(_JOBS.c[name] for name in (
    "id", "tenant_id", "webhook", "batch_id", "queue", "created_at", "started_at", "first_token_at",
    "finished_at", "error_code", "deadline_at", "service_tier", "preemptions", "run_at", "finish_reason")),
    _JOBS.c.responses_request.is_not(None).label("is_response"), webhook_events.TENANT_SUBSCRIBED)
_FINISHED = select(*FINISHED_COLUMNS).where(_JOBS.c.id.in_(bindparam("ids", expanding=True)))  # built once


def record_finished(session: Session, job_ids: list[str], status: str, now: datetime) -> None:
    """Runs inside the transition's transaction; each feature reacting to finished jobs adds its call here.
    Batch lines are looked at only for jobs of a batch (the batch runner sets their batch_id)."""
    if not job_ids:
        return
    finished = session.connection().execute(_FINISHED, {"ids": job_ids}).all()  # plain rows: no ORM layer
    webhook_events.enqueue_job_events(session, finished, status, now)
    of_batches = [row.id for row in finished if row.batch_id is not None]
    if of_batches:
        batch_outcomes.record_outcomes(session, of_batches, status, now)
    outcome_counts.record_finished_jobs(session, finished, of_batches, status)  # the API's job metrics
