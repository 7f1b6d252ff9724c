"""Three JSON columns on jobs, NULL for every job that sets none of them:
- jobs.chat: how a chat job's messages are rendered and its answer read: the tools offered, tool_choice,
  parallel_tool_calls and the tool parser, and the chat template's options (add_generation_prompt,
  continue_final_message, chat_template_kwargs);
- jobs.choices: every choice of a job that asked for n > 1 (the result columns hold choice 0's);
- jobs.prompt_logprobs: each prompt token's logprob and alternatives, for a job that asked for them.

Revision ID: 0011_openai_job_fields
Revises: 0010_job_batch_id
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011_openai_job_fields"
down_revision = "0010_job_batch_id"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:  # batch mode, as SQLite needs for ALTER TABLE
        batch.add_column(sa.Column("chat", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("choices", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("prompt_logprobs", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("prompt_logprobs")
        batch.drop_column("choices")
        batch.drop_column("chat")
