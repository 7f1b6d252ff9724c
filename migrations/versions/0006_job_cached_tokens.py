"""Jobs keep how many of their prompt tokens the engine found in its prefix cache (usage.cached_tokens).

Revision ID: 0006_job_cached_tokens
Revises: 0005_batch_backoff
Create Date: 2026-12-08
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_job_cached_tokens"
down_revision = "0005_batch_backoff"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:  # batch mode, as SQLite needs for ALTER TABLE
        # nullable, no default: jobs stored before have no figure, like their other token counts until done
        batch.add_column(sa.Column("cached_tokens", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("cached_tokens")
