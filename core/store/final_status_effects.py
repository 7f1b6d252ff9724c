"""What else changes, in the same transaction, when jobs reach a final status.

Every transition into succeeded, failed, cancelled or expired calls `record_finished` before its commit,
only for the rows it actually changed, so whatever reacts here (webhook events, batch counters) happens
exactly once per job and never for a transition that lost a race.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from conveyor.core.store import batch_outcomes, outcome_counts, webhook_events
from conveyor.core.store.tables import Job

# What the effects read of each finished job, in one query for all of them.
FINISHED_COLUMNS = (Job.id, Job.tenant_id, Job.webhook, Job.batch_id, Job.queue, Job.created_at,
                    Job.started_at, Job.first_token_at, Job.finished_at, Job.error_code, Job.deadline_at,
                    Job.service_tier, Job.preemptions, Job.run_at, Job.finish_reason,
                    Job.responses_request.is_not(None).label("is_response"))


def record_finished(session: Session, job_ids: list[str], status: str, now: datetime) -> None:
    """Runs inside the transition's transaction; each feature reacting to finished jobs adds its call here.
    Batch lines are looked at only for jobs of a batch (the batch runner sets their batch_id)."""
    finished = session.execute(select(*FINISHED_COLUMNS).where(Job.id.in_(job_ids))).all()
    webhook_events.enqueue_job_events(session, finished, status, now)
    of_batches = [row.id for row in finished if row.batch_id is not None]
    if of_batches:
        batch_outcomes.record_outcomes(session, of_batches, status, now)
    outcome_counts.record_finished_jobs(session, finished, of_batches, status)  # the API's job metrics
