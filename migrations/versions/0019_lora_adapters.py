"""LoRA adapters loaded at run time (issue 35): POST /v1/load_lora_adapter writes one row, the workers of its
base model load it when a job first names it, POST /v1/unload_lora_adapter deletes it (refused while queued or
running jobs name it). Adapters declared in the configuration are not stored.

Revision ID: 0019_lora_adapters
Revises: 0018_embedding_jobs
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019_lora_adapters"
down_revision = "0018_embedding_jobs"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "lora_adapters",
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("model_id", sa.String(128), nullable=False),
        sa.Column("path", sa.String(1024), nullable=False),
        sa.Column("tenants", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("lora_adapters")
