"""Urgency by slack, goodput per tier, workers' measured rates, tenants' priority range.

- jobs.start_by: the latest moment the job can start and still meet its deadline (deadline_at minus its
  predicted run time, core/store/finish_times.py); fleet claims order by it while the deadline is ahead.
- jobs.service_tier: the OpenAI service tier the request named (NULL: none), counted apart in goodput.
- workers.rates: the worker engine's measured rates (core/store/workers.py EngineRates), published with its
  heartbeat; submit predicts run and finish times from them.
- tenants.min_priority / tenants.max_priority: the priorities a tenant may ask for (NULL: unbounded).

Revision ID: 0013_urgency_slack_tiers
Revises: 0012_job_priority_deadline
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013_urgency_slack_tiers"
down_revision = "0012_job_priority_deadline"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:  # batch mode, as SQLite needs for ALTER TABLE
        batch.add_column(sa.Column("start_by", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("service_tier", sa.String(16), nullable=True))
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("rates", sa.JSON(), nullable=True))
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("min_priority", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("max_priority", sa.Integer(), nullable=True))


def downgrade() -> None:
    # Plain ALTER TABLE DROP COLUMN (SQLite 3.35+ has it): batch mode would copy and drop `tenants`, which
    # the rows of jobs and api_keys reference.
    for table, column in (("tenants", "max_priority"), ("tenants", "min_priority"), ("workers", "rates"),
                          ("jobs", "service_tier"), ("jobs", "start_by")):
        op.drop_column(table, column)
