"""The console's sessions in the store (issue 51): signing out ends a session on every API process, and a
form's CSRF token is derived from its session. A row per signed-in browser (per visiting browser with auth
off), deleted at sign-out and once expired.

Revision ID: 0022_console_sessions
Revises: 0021_failed_jobs_index
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0022_console_sessions"
down_revision = "0021_failed_jobs_index"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "console_sessions",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("key_id", sa.String(40), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_console_sessions_expires_at", "console_sessions", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_console_sessions_expires_at", "console_sessions")
    op.drop_table("console_sessions")
