"""Tenants get a prefix-cache namespace: NULL (every existing tenant) keeps each tenant's cached prefixes its
own; tenants given the same name share theirs (`conveyor tenants set --cache-namespace`).

Revision ID: 0009_tenant_cache_namespace
Revises: 0008_metric_counts
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009_tenant_cache_namespace"
down_revision = "0008_metric_counts"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:  # batch mode, as SQLite needs for ALTER TABLE
        batch.add_column(sa.Column("cache_namespace", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("cache_namespace")
