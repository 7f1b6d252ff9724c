"""Jobs carry their urgency within the queue: jobs.priority (lower first, 0 for every existing job) and
jobs.deadline_at (the soft target created_at + deadline_s; NULL: none), which fleet claims and engine
admission order by; and jobs.predicted_finish_at, when submit predicted one (core/store/finish_times.py).

Revision ID: 0012_job_priority_deadline
Revises: 0011_openai_job_fields
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012_job_priority_deadline"
down_revision = "0011_openai_job_fields"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:  # batch mode, as SQLite needs for ALTER TABLE
        batch.add_column(sa.Column("priority", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("deadline_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("predicted_finish_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("predicted_finish_at")
        batch.drop_column("deadline_at")
        batch.drop_column("priority")
