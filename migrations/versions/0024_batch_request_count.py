"""Batches keep how many requests they were created with, when that is known at create: a Message Batch
(POST /v1/messages/batches) lists its requests in its body, and Anthropic's `request_counts.processing` shows
them all from the start, before the runner has read a line.

- batches.request_count: the requests in the batch's input; NULL: not known until its input is read (a
  batch of an uploaded file or an S3 object counts its lines as it reads them, in `total`).

Revision ID: 0024_batch_request_count
Revises: 0023_job_draft_tokens
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0024_batch_request_count"
down_revision = "0023_job_draft_tokens"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches") as batch:  # batch mode, as SQLite needs for ALTER TABLE
        batch.add_column(sa.Column("request_count", sa.Integer(), nullable=True))


def downgrade() -> None:
    # A plain DROP COLUMN (SQLite >= 3.35 has it): batch mode would rebuild `batches`, which SQLite refuses
    # while jobs and batch lines refer to it.
    op.execute(sa.text("ALTER TABLE batches DROP COLUMN request_count"))
