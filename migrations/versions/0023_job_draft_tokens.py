"""Jobs keep how many tokens speculative decoding drafted for them and how many of those the model accepted
(usage.draft_tokens, usage.accepted_draft_tokens).

Revision ID: 0023_job_draft_tokens
Revises: 0022_console_sessions
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0023_job_draft_tokens"
down_revision = "0022_console_sessions"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:  # batch mode, as SQLite needs for ALTER TABLE
        # nullable, no default: jobs stored before have no figure, as cached_tokens had none before 0006
        batch.add_column(sa.Column("draft_tokens", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("accepted_draft_tokens", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("accepted_draft_tokens")
        batch.drop_column("draft_tokens")
