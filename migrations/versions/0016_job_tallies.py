"""Job tallies: each queue's and tenant's queued and running jobs (and the output they may still write),
kept by triggers on jobs, so that /v1/queues, /v1/scaling, /metrics and deadline forecasts stop counting
the backlog (issue 32; core/store/job_tallies.py).

- job_tally_deltas: one row per change, written by the triggers in the transaction that moves a job into or
  out of `queued` or `running` (insert, status change, delete): +1 or -1 job and its output bound
  (max_tokens x n, max_tokens 16 when unset: core/store/token_usage.py DEFAULT_MAX_TOKENS). Appending rows
  never makes two transactions wait on each other, as updating one counter row per queue would.
- job_tallies: the deltas folded in, one row per (queue, tenant, status); folded by the reconciler and by a
  reader that found many deltas.

The tallies start from the jobs queued and running now: creating the triggers takes a lock that holds
writes to jobs until this migration commits, so none is counted twice or missed.

Revision ID: 0016_job_tallies
Revises: 0015_claim_urgency_indexes
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016_job_tallies"
down_revision = "0015_claim_urgency_indexes"
branch_labels = None
depends_on = None

TALLIED = "('queued', 'running')"
TRIGGERS = ("jobs_tally_insert", "jobs_tally_update", "jobs_tally_delete", "jobs_tally_update_old",
            "jobs_tally_update_new")


def _bound(row: str, dialect: str) -> str:
    """The SQL of a job row's output bound (max_tokens x n) in a trigger (`row`: NEW or OLD)."""
    if dialect == "postgresql":
        return (f"COALESCE(({row}.params->>'max_tokens')::bigint, 16)"
                f" * COALESCE(({row}.params->>'n')::bigint, 1)")
    return (f"COALESCE(CAST(json_extract({row}.params, '$.max_tokens') AS INTEGER), 16)"
            f" * COALESCE(CAST(json_extract({row}.params, '$.n') AS INTEGER), 1)")


def _delta(row: str, sign: str, dialect: str) -> str:
    return ("INSERT INTO job_tally_deltas (queue, tenant_id, status, jobs, output_bound)"
            f" VALUES ({row}.queue, {row}.tenant_id, {row}.status, {sign}1, {sign}({_bound(row, dialect)}));")


def upgrade() -> None:
    op.create_table(
        "job_tallies",
        sa.Column("queue", sa.String(64), primary_key=True),
        sa.Column("tenant_id", sa.String(64), primary_key=True),
        sa.Column("status", sa.String(16), primary_key=True),
        sa.Column("jobs", sa.BigInteger(), nullable=False),
        sa.Column("output_bound", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "job_tally_deltas",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True,
                  autoincrement=True),
        sa.Column("queue", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("jobs", sa.BigInteger(), nullable=False),
        sa.Column("output_bound", sa.BigInteger(), nullable=False),
    )
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        _postgres_triggers()
    else:
        _sqlite_triggers()
    op.execute(sa.text(
        "INSERT INTO job_tallies (queue, tenant_id, status, jobs, output_bound)"
        f" SELECT queue, tenant_id, status, count(*), sum({_bound('jobs', dialect)}) FROM jobs"
        f" WHERE status IN {TALLIED} GROUP BY queue, tenant_id, status"))


def _postgres_triggers() -> None:
    op.execute(sa.text(f"""
        CREATE FUNCTION conveyor_job_tally() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF TG_OP <> 'INSERT' AND OLD.status IN {TALLIED} THEN
                {_delta("OLD", "-", "postgresql")}
            END IF;
            IF TG_OP <> 'DELETE' AND NEW.status IN {TALLIED} THEN
                {_delta("NEW", "+", "postgresql")}
            END IF;
            RETURN NULL;
        END $$"""))
    for name, event, when in (
        ("jobs_tally_insert", "INSERT", f"NEW.status IN {TALLIED}"),
        ("jobs_tally_update", "UPDATE OF status", "OLD.status IS DISTINCT FROM NEW.status"),
        ("jobs_tally_delete", "DELETE", f"OLD.status IN {TALLIED}"),
    ):
        op.execute(sa.text(f"CREATE TRIGGER {name} AFTER {event} ON jobs FOR EACH ROW WHEN ({when})"
                           " EXECUTE FUNCTION conveyor_job_tally()"))


def _sqlite_triggers() -> None:
    changed = "OLD.status IS NOT NEW.status"
    for name, event, when, row, sign in (
        ("jobs_tally_insert", "INSERT", f"NEW.status IN {TALLIED}", "NEW", "+"),
        ("jobs_tally_update_old", "UPDATE OF status", f"{changed} AND OLD.status IN {TALLIED}", "OLD", "-"),
        ("jobs_tally_update_new", "UPDATE OF status", f"{changed} AND NEW.status IN {TALLIED}", "NEW", "+"),
        ("jobs_tally_delete", "DELETE", f"OLD.status IN {TALLIED}", "OLD", "-"),
    ):
        op.execute(sa.text(f"CREATE TRIGGER {name} AFTER {event} ON jobs FOR EACH ROW WHEN {when}"
                           f" BEGIN {_delta(row, sign, 'sqlite')} END"))


def downgrade() -> None:
    for name in TRIGGERS:
        op.execute(sa.text(f"DROP TRIGGER IF EXISTS {name}" + (
            " ON jobs" if op.get_bind().dialect.name == "postgresql" else "")))
    if op.get_bind().dialect.name == "postgresql":
        op.execute(sa.text("DROP FUNCTION conveyor_job_tally()"))
    op.drop_table("job_tally_deltas")
    op.drop_table("job_tallies")
