"""Trace exports (issue 57): ix_jobs_created (created_at, id), so that `conveyor trace export` reads the
jobs of its window page by page (keyset on created_at, id) without scanning the table for each page when no
tenant narrows it. created_at only grows: each insert adds at the index's right edge.

Revision ID: 0027_jobs_created_index
Revises: 0026_tally_scheduled_republish
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op

revision = "0027_jobs_created_index"
down_revision = "0026_tally_scheduled_republish"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_jobs_created", "jobs", ["created_at", "id"])


def downgrade() -> None:
    op.drop_index("ix_jobs_created", "jobs")
