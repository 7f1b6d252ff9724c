"""Embedding jobs (issue 34): a job's kind, an embedding job's inputs and its vectors.

- jobs.kind: "generation" (every job stored so far: the server default) or "embedding";
- jobs.inputs: an embedding job's inputs (JSON: each a text or a list of token ids), NULL otherwise;
- jobs.embeddings: a succeeded embedding job's vectors (JSON: one base64 string of little-endian float32
  per input, core/views/embedding_vectors.py), NULL otherwise.

A downgrade deletes the embedding jobs first (an older release would read them as generation jobs without a
prompt), with their webhook deliveries and attempts; their batch lines keep no job.

Revision ID: 0018_embedding_jobs
Revises: 0017_model_lanes
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018_embedding_jobs"
down_revision = "0017_model_lanes"
branch_labels = None
depends_on = None

EMBEDDING_JOBS = "SELECT id FROM jobs WHERE kind = 'embedding'"
THEIR_DELIVERIES = ("SELECT id FROM webhook_deliveries WHERE subject_type = 'job'"
                    f" AND subject_id IN ({EMBEDDING_JOBS})")


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:  # batch mode, as SQLite needs for ALTER TABLE
        batch.add_column(sa.Column("kind", sa.String(16), nullable=False, server_default="generation"))
        batch.add_column(sa.Column("inputs", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("embeddings", sa.JSON(), nullable=True))


def downgrade() -> None:
    # Children first: no ON DELETE CASCADE.
    op.execute(sa.text(f"DELETE FROM webhook_attempts WHERE delivery_id IN ({THEIR_DELIVERIES})"))
    op.execute(sa.text(f"DELETE FROM webhook_deliveries WHERE id IN ({THEIR_DELIVERIES})"))
    op.execute(sa.text(f"UPDATE batch_lines SET job_id = NULL WHERE job_id IN ({EMBEDDING_JOBS})"))
    op.execute(sa.text("DELETE FROM jobs WHERE kind = 'embedding'"))
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("embeddings")
        batch.drop_column("inputs")
        batch.drop_column("kind")
