"""The console's recent failures (issue 37): ix_jobs_failed_finished (finished_at) WHERE status IN ('failed',
'expired'), so "which jobs failed in the last hour, and why" reads the failures of that hour, not the
table. Failures are few: the index costs their inserts only.

Revision ID: 0021_failed_jobs_index
Revises: 0020_scheduled_jobs
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021_failed_jobs_index"
down_revision = "0020_scheduled_jobs"
branch_labels = None
depends_on = None

FAILED = "status IN ('failed', 'expired')"


def upgrade() -> None:
    op.create_index("ix_jobs_failed_finished", "jobs", ["finished_at"], postgresql_where=sa.text(FAILED),
                    sqlite_where=sa.text(FAILED))


def downgrade() -> None:
    op.drop_index("ix_jobs_failed_finished", "jobs")
