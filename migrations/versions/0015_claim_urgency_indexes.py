"""Indexes that let a fair claim read a stream's next jobs in urgency order without sorting the stream's
whole backlog (issue 32; core/store/queued_streams.py most_urgent):

- ix_jobs_queued_urgency (queue, tenant_id, batch_id, priority, created_at, id) WHERE status = 'queued': jobs
  without a deadline ahead, by priority, then arrival.
- ix_jobs_queued_slack (queue, tenant_id, batch_id, priority, start_by, created_at, id) WHERE status =
  'queued' AND deadline_at IS NOT NULL: jobs with a deadline, by priority, then latest start.

Claims order deadline jobs by start_by alone, so every queued job with a deadline gets one: jobs queued
before migration 0013 had none, and take their deadline (what claims used for them until now).

PostgreSQL builds each index while holding a lock that blocks writes to jobs; both cover queued rows only
(docs/operations/upgrades.md).

Revision ID: 0015_claim_urgency_indexes
Revises: 0014_job_partial_indexes
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015_claim_urgency_indexes"
down_revision = "0014_job_partial_indexes"
branch_labels = None
depends_on = None

INDEXES: dict[str, tuple[list[str], str]] = {
    "ix_jobs_queued_urgency": (["queue", "tenant_id", "batch_id", "priority", "created_at", "id"],
                               "status = 'queued'"),
    "ix_jobs_queued_slack": (["queue", "tenant_id", "batch_id", "priority", "start_by", "created_at", "id"],
                             "status = 'queued' AND deadline_at IS NOT NULL"),
}


def upgrade() -> None:
    op.execute(sa.text("UPDATE jobs SET start_by = deadline_at"
                       " WHERE status = 'queued' AND deadline_at IS NOT NULL AND start_by IS NULL"))
    for name, (columns, where) in INDEXES.items():
        op.create_index(name, "jobs", columns, postgresql_where=sa.text(where), sqlite_where=sa.text(where))


def downgrade() -> None:
    for name in INDEXES:
        op.drop_index(name, table_name="jobs")
