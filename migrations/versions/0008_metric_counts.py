"""Cluster-wide outcome counters (job latency histograms, failures by code, webhook deliveries, batch
lines), written in the transaction that makes each outcome final, read by every API's /metrics.

Revision ID: 0008_metric_counts
Revises: 0007_tenant_limits
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_metric_counts"
down_revision = "0007_tenant_limits"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "metric_counts",
        sa.Column("metric", sa.String(64), primary_key=True),
        sa.Column("queue", sa.String(64), primary_key=True),
        sa.Column("status", sa.String(16), primary_key=True),
        sa.Column("label", sa.String(64), primary_key=True),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.Column("total", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("metric_counts")
