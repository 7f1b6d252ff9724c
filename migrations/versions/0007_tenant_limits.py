"""Tenants get their own limits: fair-share weight, quotas and data retention (NULL: the settings' default);
an API key may be an admin key (sees totals across tenants).

Revision ID: 0007_tenant_limits
Revises: 0006_job_cached_tokens
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_tenant_limits"
down_revision = "0006_job_cached_tokens"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:  # batch mode, as SQLite needs for ALTER TABLE
        batch.add_column(sa.Column("weight", sa.Float(), nullable=True))
        batch.add_column(sa.Column("max_queued", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("max_running", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("tokens_per_minute", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("retention_days", sa.Integer(), nullable=True))
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("is_admin", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("is_admin")
    with op.batch_alter_table("tenants") as batch:
        for column in ("retention_days", "tokens_per_minute", "max_running", "max_queued", "weight"):
            batch.drop_column(column)
