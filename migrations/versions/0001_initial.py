"""Initial schema: tenants, api_keys, jobs, workers; the `default` tenant used when auth is off.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

from datetime import datetime, timezone

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _ts(name: str, nullable: bool = True) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    tenants = op.create_table(
        "tenants",
        sa.Column("id", sa.String(64), primary_key=True),
        _ts("created_at", nullable=False),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        _ts("created_at", nullable=False),
        _ts("revoked_at"),
    )
    op.create_index("ix_api_keys_tenant_id", "api_keys", ["tenant_id"])
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("queue", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("prompt", sa.Text(), nullable=True),
        sa.Column("messages", sa.JSON(), nullable=True),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("webhook", sa.JSON(), nullable=True),
        sa.Column("idempotency_key", sa.String(255), nullable=True),
        sa.Column("request_hash", sa.String(64), nullable=False),
        sa.Column("ttl_s", sa.Float(), nullable=True),
        sa.Column("timeout_s", sa.Float(), nullable=True),
        _ts("expires_at"),
        _ts("created_at", nullable=False),
        _ts("started_at"),
        _ts("first_token_at"),
        _ts("finished_at"),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("preemptions", sa.Integer(), nullable=False),
        sa.Column("result_text", sa.Text(), nullable=True),
        sa.Column("finish_reason", sa.String(16), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("error_code", sa.String(64), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("worker_id", sa.String(128), nullable=True),
        _ts("dispatched_at"),
        _ts("updated_at", nullable=False),
        sa.UniqueConstraint("tenant_id", "idempotency_key", name="uq_jobs_tenant_idempotency_key"),
    )
    op.create_index("ix_jobs_tenant_created", "jobs", ["tenant_id", "created_at", "id"])
    op.create_index("ix_jobs_status_queue", "jobs", ["status", "queue"])
    op.create_table(
        "workers",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("hostname", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("queues", sa.JSON(), nullable=False),
        _ts("started_at", nullable=False),
        _ts("last_seen_at", nullable=False),
        _ts("stopped_at"),
    )
    op.create_index("ix_workers_last_seen_at", "workers", ["last_seen_at"])
    # Naive UTC works on both backends: SQLite stores it as is, Postgres reads it in the session time zone,
    # which only shifts the creation time of this one row.
    created = datetime.now(timezone.utc).replace(tzinfo=None)
    op.bulk_insert(tenants, [{"id": "default", "created_at": created}])


def downgrade() -> None:
    op.drop_table("workers")
    op.drop_table("jobs")
    op.drop_table("api_keys")
    op.drop_table("tenants")
