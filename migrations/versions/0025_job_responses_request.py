"""Jobs submitted through OpenAI's Responses API (POST /v1/responses) keep what that request said beyond the
job's own fields (instructions, input items, previous_response_id, background, store, text format, tools as
sent), so the job can show itself as a `response`.

Revision ID: 0025_job_responses_request
Revises: 0024_batch_request_count
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0025_job_responses_request"
down_revision = "0024_batch_request_count"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:  # batch mode, as SQLite needs for ALTER TABLE
        batch.add_column(sa.Column("responses_request", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("responses_request")
