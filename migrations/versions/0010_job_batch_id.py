"""Jobs name the batch whose line they answer in a column of their own (jobs.batch_id, indexed, a foreign key
to batches), set by the batch runner only: fair share groups a tenant's streams by it, so a client's metadata
holding "batch_id" no longer makes a stream. Existing batch jobs get theirs from their batch line (the
store's own record, not the metadata).

Revision ID: 0010_job_batch_id
Revises: 0009_tenant_cache_namespace
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010_job_batch_id"
down_revision = "0009_tenant_cache_namespace"
branch_labels = None
depends_on = None

BACKFILL = """
UPDATE jobs SET batch_id = (SELECT batch_lines.batch_id FROM batch_lines WHERE batch_lines.job_id = jobs.id)
WHERE id IN (SELECT job_id FROM batch_lines WHERE job_id IS NOT NULL)
"""


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:  # batch mode, as SQLite needs for ALTER TABLE
        batch.add_column(sa.Column("batch_id", sa.String(40), nullable=True))
        batch.create_foreign_key("fk_jobs_batch_id", "batches", ["batch_id"], ["id"])
        batch.create_index("ix_jobs_batch_id", ["batch_id"])
    op.execute(BACKFILL)


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_batch_id")
        batch.drop_constraint("fk_jobs_batch_id", type_="foreignkey")
        batch.drop_column("batch_id")
