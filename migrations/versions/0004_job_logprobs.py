"""Jobs keep the logprobs they were asked for: per generated token, its id, text, logprob and alternatives.

Revision ID: 0004_job_logprobs
Revises: 0003_batches
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_job_logprobs"
down_revision = "0003_batches"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:  # batch mode: SQLite has no ALTER TABLE ... ADD with JSON
        batch.add_column(sa.Column("logprobs", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("logprobs")
