"""Partial indexes over the rows each per-job and per-round query reads, so their cost follows the backlog
they look at, not the finished history kept for retention (issue 32; `conveyor bench-store --explain`):

- ix_jobs_queued (queue, tenant_id, batch_id, created_at, id) WHERE status = 'queued': a tenant's stream in
  fair claims, count_queued per tenant at submit, the per-tenant /v1/queues counts, the backlog read.
- ix_jobs_queued_expiry (expires_at) WHERE status = 'queued' AND expires_at IS NOT NULL: the reconciler's
  expiry sweep.
- ix_jobs_undispatched (created_at) WHERE status = 'queued' AND dispatched_at IS NULL: its re-publish sweep.
- ix_jobs_dispatched_queued (queue, dispatched_at, created_at, id) WHERE status = 'queued' AND dispatched_at
  IS NOT NULL: its lost-message sweep, earliest dispatched first.
- ix_jobs_succeeded_finished (queue, finished_at) WHERE status = 'succeeded': a queue's delivered tokens of
  the last minutes (finish_times.queue_rate, every submit with a deadline).
- ix_jobs_deadline_finished (finished_at) WHERE deadline_at IS NOT NULL: goodput of the last hour.

And /metrics stops counting the jobs table for its finished-jobs counters: they are counted when each job
becomes final (metric_counts rows `jobs_finished`, core/store/outcome_counts.py); this migration counts the
jobs already final, once.

PostgreSQL builds each index while holding a lock that blocks writes to jobs (a plain CREATE INDEX: Alembic
runs in a transaction); on a large table, run the upgrade in a quiet moment (docs/operations/upgrades.md).

Revision ID: 0014_job_partial_indexes
Revises: 0013_urgency_slack_tiers
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014_job_partial_indexes"
down_revision = "0013_urgency_slack_tiers"
branch_labels = None
depends_on = None

INDEXES: dict[str, tuple[list[str], str]] = {
    "ix_jobs_queued": (["queue", "tenant_id", "batch_id", "created_at", "id"], "status = 'queued'"),
    "ix_jobs_queued_expiry": (["expires_at"], "status = 'queued' AND expires_at IS NOT NULL"),
    "ix_jobs_undispatched": (["created_at"], "status = 'queued' AND dispatched_at IS NULL"),
    "ix_jobs_dispatched_queued": (["queue", "dispatched_at", "created_at", "id"],
                                  "status = 'queued' AND dispatched_at IS NOT NULL"),
    "ix_jobs_succeeded_finished": (["queue", "finished_at"], "status = 'succeeded'"),
    "ix_jobs_deadline_finished": (["finished_at"], "deadline_at IS NOT NULL"),
}


COUNT_FINISHED = sa.text(
    "INSERT INTO metric_counts (metric, queue, status, label, count, total)"
    " SELECT 'jobs_finished', queue, status, '', count(*), coalesce(sum(preemptions), 0) FROM jobs"
    " WHERE status IN ('succeeded', 'failed', 'cancelled', 'expired') GROUP BY queue, status"
)


def upgrade() -> None:
    for name, (columns, where) in INDEXES.items():
        op.create_index(name, "jobs", columns, postgresql_where=sa.text(where), sqlite_where=sa.text(where))
    op.execute(COUNT_FINISHED)


def downgrade() -> None:
    op.execute(sa.text("DELETE FROM metric_counts WHERE metric = 'jobs_finished'"))
    for name in INDEXES:
        op.drop_index(name, table_name="jobs")
