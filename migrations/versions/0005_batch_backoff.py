"""Batches back off when their rounds fail: consecutive failures, when the next attempt is due, and the last
failure's cause, kept in the row so the backoff holds across worker processes and restarts.

Revision ID: 0005_batch_backoff
Revises: 0004_job_logprobs
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_batch_backoff"
down_revision = "0004_job_logprobs"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches") as batch:  # batch mode, as SQLite needs for ALTER TABLE
        # server_default: the batches already stored start with no failure
        batch.add_column(sa.Column("failure_count", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("last_failure", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("last_failure")
        batch.drop_column("next_attempt_at")
        batch.drop_column("failure_count")
