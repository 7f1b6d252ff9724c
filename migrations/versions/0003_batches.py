"""Batches: uploaded and generated files, batches (lease, read position, counters) and their lines.

Revision ID: 0003_batches
Revises: 0002_webhooks
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_batches"
down_revision = "0002_webhooks"
branch_labels = None
depends_on = None


def _ts(name: str, nullable: bool = True) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(255), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        _ts("created_at", nullable=False),
    )
    op.create_index("ix_files_tenant_created", "files", ["tenant_id", "created_at", "id"])
    op.create_table(
        "batches",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=True),
        sa.Column("input_url", sa.Text(), nullable=False),
        sa.Column("input_file_id", sa.String(40), nullable=True),
        sa.Column("output_url", sa.Text(), nullable=True),
        sa.Column("queue", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("webhook", sa.JSON(), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("stop_reason", sa.String(16), nullable=True),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("completed", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.Column("cancelled", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("read_line", sa.Integer(), nullable=False),
        sa.Column("read_offset", sa.BigInteger(), nullable=False),
        sa.Column("read_done", sa.Boolean(), nullable=False),
        sa.Column("lease_owner", sa.String(128), nullable=True),
        _ts("lease_expires_at"),
        sa.Column("output_file_id", sa.String(40), nullable=True),
        sa.Column("error_file_id", sa.String(40), nullable=True),
        sa.Column("outputs", sa.JSON(), nullable=True),
        sa.Column("errors", sa.JSON(), nullable=True),
        _ts("created_at", nullable=False),
        _ts("expires_at"),
        _ts("in_progress_at"),
        _ts("finalizing_at"),
        _ts("cancelling_at"),
        _ts("finished_at"),
        _ts("updated_at", nullable=False),
    )
    op.create_index("ix_batches_tenant_created", "batches", ["tenant_id", "created_at", "id"])
    op.create_index("ix_batches_status", "batches", ["status"])
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.String(40), sa.ForeignKey("batches.id"), primary_key=True),
        sa.Column("line", sa.Integer(), primary_key=True),
        sa.Column("custom_id", sa.String(512), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("job_id", sa.String(40), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.UniqueConstraint("batch_id", "custom_id", name="uq_batch_lines_custom_id"),
    )
    op.create_index("ix_batch_lines_batch_status", "batch_lines", ["batch_id", "status"])
    op.create_index("ix_batch_lines_job_id", "batch_lines", ["job_id"])


def downgrade() -> None:
    op.drop_table("batch_lines")
    op.drop_table("batches")
    op.drop_table("files")
