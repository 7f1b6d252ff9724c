"""Scheduled jobs, retries on request and a retry policy (issue 36).

- jobs.run_at: when a job submitted with `run_at` or `delay_s` is due (it waits in status `scheduled`
  until then), or when a job whose retryable failure is being retried runs again; NULL: at once.
- jobs.history: the outcomes of the job's earlier attempts, oldest first (JSON list), each kept when the job
  was retried (POST /v1/jobs/{id}/retry, or the retry policy); NULL: none.
- jobs.max_retries: the automatic retries its retryable failures get; NULL: its queue's default.
- jobs.retries: the automatic retries used so far (since its last retry on request).
- batches.run_at: when a scheduled batch's lines are due.
- ix_jobs_scheduled (run_at, id) WHERE status = 'scheduled': the scheduler's due sweep reads only the
  scheduled jobs, earliest due first.

Scheduled jobs are not tallied (migration 0016 counts `queued` and `running`): a queue's depth and the
scaling signal count a scheduled job only once it is due.

Revision ID: 0020_scheduled_jobs
Revises: 0019_lora_adapters
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020_scheduled_jobs"
down_revision = "0019_lora_adapters"
branch_labels = None
depends_on = None

SCHEDULED = "status = 'scheduled'"


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:  # batch mode, as SQLite needs for ALTER TABLE
        batch.add_column(sa.Column("run_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("history", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("max_retries", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("retries", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("run_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index("ix_jobs_scheduled", "jobs", ["run_at", "id"], postgresql_where=sa.text(SCHEDULED),
                    sqlite_where=sa.text(SCHEDULED))


def downgrade() -> None:
    # An older release knows no `scheduled` status: its jobs are cancelled, as a purge would.
    op.execute(sa.text("UPDATE jobs SET status = 'cancelled', error_code = 'cancelled', error_message ="
                       " 'cancelled by a downgrade: this release has no scheduled jobs', finished_at ="
                       f" updated_at WHERE {SCHEDULED}"))
    op.drop_index("ix_jobs_scheduled", "jobs")
    # A plain DROP COLUMN (SQLite >= 3.35 has it): batch mode would rebuild the tables, and SQLite refuses to
    # drop `batches` while jobs refer to it (and a rebuilt `jobs` would lose its tally triggers).
    for table, column in (("batches", "run_at"), ("jobs", "retries"), ("jobs", "max_retries"),
                          ("jobs", "history"), ("jobs", "run_at")):
        op.execute(sa.text(f"ALTER TABLE {table} DROP COLUMN {column}"))
