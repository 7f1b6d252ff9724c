"""Scheduled jobs in the tallies, and a broker restart's republish walked from a cursor (issue 56).

- The tally triggers (migration 0016) count `scheduled` too, so that a tenant's scheduled jobs (admission's
  limit on them), /v1/queues, the console and /metrics read them from `job_tallies` instead of counting
  the rows (core/store/job_tallies.py). The tally starts from the jobs scheduled now: dropping and creating
  the triggers locks `jobs` until this migration commits, so none is counted twice or missed.
- broker_republish: one row, the walk that publishes every queued job again after the broker lost its
  queues (core/store/republish_walk.py): its generation, the time before which messages may be lost, and
  where the walk stands (lane, last job published). It replaces an UPDATE of `dispatched_at` per job.

Revision ID: 0026_tally_scheduled_republish
Revises: 0025_job_responses_request
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0026_tally_scheduled_republish"
down_revision = "0025_job_responses_request"
branch_labels = None
depends_on = None

TALLIED = "('scheduled', 'queued', 'running')"
TALLIED_BEFORE = "('queued', 'running')"  # migration 0016's


def upgrade() -> None:
    _tally_triggers(TALLIED)
    dialect = op.get_bind().dialect.name
    op.execute(sa.text(
        "INSERT INTO job_tallies (queue, tenant_id, status, jobs, output_bound)"
        f" SELECT queue, tenant_id, status, count(*), sum({_bound('jobs', dialect)}) FROM jobs"
        " WHERE status = 'scheduled' GROUP BY queue, tenant_id, status"))
    op.create_table(
        "broker_republish",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("lost_before", sa.DateTime(timezone=True), nullable=True),
        sa.Column("lane", sa.String(64), nullable=True),
        sa.Column("after_dispatched_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("after_created_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("after_id", sa.String(40), nullable=True),
        sa.Column("published", sa.BigInteger(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("broker_republish")
    _tally_triggers(TALLIED_BEFORE)
    for table in ("job_tallies", "job_tally_deltas"):
        op.execute(sa.text(f"DELETE FROM {table} WHERE status = 'scheduled'"))


def _tally_triggers(tallied: str) -> None:
    if op.get_bind().dialect.name == "postgresql":
        _postgres_triggers(tallied)
    else:
        _sqlite_triggers(tallied)


def _bound(row: str, dialect: str) -> str:
    """The SQL of a job row's output bound (max_tokens x n) in a trigger (`row`: NEW or OLD), as 0016's."""
    if dialect == "postgresql":
        return (f"COALESCE(({row}.params->>'max_tokens')::bigint, 16)"
                f" * COALESCE(({row}.params->>'n')::bigint, 1)")
    return (f"COALESCE(CAST(json_extract({row}.params, '$.max_tokens') AS INTEGER), 16)"
            f" * COALESCE(CAST(json_extract({row}.params, '$.n') AS INTEGER), 1)")


def _delta(row: str, sign: str, dialect: str) -> str:
    return ("INSERT INTO job_tally_deltas (queue, tenant_id, status, jobs, output_bound)"
            f" VALUES ({row}.queue, {row}.tenant_id, {row}.status, {sign}1, {sign}({_bound(row, dialect)}));")


def _postgres_triggers(tallied: str) -> None:
    # The function in place; the triggers whose WHEN names the statuses made again (a WHEN cannot change).
    op.execute(sa.text(f"""
        CREATE OR REPLACE FUNCTION conveyor_job_tally() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF TG_OP <> 'INSERT' AND OLD.status IN {tallied} THEN
                {_delta("OLD", "-", "postgresql")}
            END IF;
            IF TG_OP <> 'DELETE' AND NEW.status IN {tallied} THEN
                {_delta("NEW", "+", "postgresql")}
            END IF;
            RETURN NULL;
        END $$"""))
    for name, event, when in (("jobs_tally_insert", "INSERT", f"NEW.status IN {tallied}"),
                              ("jobs_tally_delete", "DELETE", f"OLD.status IN {tallied}")):
        op.execute(sa.text(f"DROP TRIGGER {name} ON jobs"))
        op.execute(sa.text(f"CREATE TRIGGER {name} AFTER {event} ON jobs FOR EACH ROW WHEN ({when})"
                           " EXECUTE FUNCTION conveyor_job_tally()"))


def _sqlite_triggers(tallied: str) -> None:
    changed = "OLD.status IS NOT NEW.status"
    for name, event, when, row, sign in (
        ("jobs_tally_insert", "INSERT", f"NEW.status IN {tallied}", "NEW", "+"),
        ("jobs_tally_update_old", "UPDATE OF status", f"{changed} AND OLD.status IN {tallied}", "OLD", "-"),
        ("jobs_tally_update_new", "UPDATE OF status", f"{changed} AND NEW.status IN {tallied}", "NEW", "+"),
        ("jobs_tally_delete", "DELETE", f"OLD.status IN {tallied}", "OLD", "-"),
    ):
        op.execute(sa.text(f"DROP TRIGGER {name}"))
        op.execute(sa.text(f"CREATE TRIGGER {name} AFTER {event} ON jobs FOR EACH ROW WHEN {when}"
                           f" BEGIN {_delta(row, sign, 'sqlite')} END"))
