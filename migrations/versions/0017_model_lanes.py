"""Lanes: a job's `queue` names its model's queue, `MODEL:QUEUE` (core/lanes.py), so that every per-queue
read, index, tally and outcome count of the store is per model too (issue 33, many models).

The jobs, tallies and outcome counts kept so far belong to the one model served until now: the default
model's id is handed in by `conveyor migrate` (core/store/migrate.py), else read from the settings. Queued
jobs are marked undispatched, so that the dispatch rule publishes them again to their lane's broker queue
(the broker queues were named by queue alone); a message left in an old queue is read by no one.

Revision ID: 0017_model_lanes
Revises: 0016_job_tallies
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op

revision = "0017_model_lanes"
down_revision = "0016_job_tallies"
branch_labels = None
depends_on = None

SEPARATOR = ":"
LANE_MAX = 64  # the queue columns' width
PER_QUEUE = {"jobs": "", "job_tallies": "", "job_tally_deltas": "", "metric_counts": " AND queue <> ''"}


def _default_model() -> str:
    given = context.config.attributes.get("default_model")
    if given:
        return str(given)
    from conveyor.core.settings import load_settings

    return load_settings().default_model_id()


def upgrade() -> None:
    model = _default_model()
    bind = op.get_bind()
    longest = bind.execute(sa.text("SELECT max(length(queue)) FROM jobs")).scalar()
    if longest is not None and len(model) + 1 + int(longest) > LANE_MAX:
        raise ValueError(f"model id {model!r} is too long to name this database's lanes: a lane "
                         f"(MODEL{SEPARATOR}QUEUE) holds at most {LANE_MAX} characters")
    for table, where in PER_QUEUE.items():
        bind.execute(sa.text(f"UPDATE {table} SET queue = :prefix || queue WHERE 1 = 1{where}"),
                     {"prefix": model + SEPARATOR})
    bind.execute(sa.text("UPDATE jobs SET dispatched_at = NULL WHERE status = 'queued'"))


def downgrade() -> None:
    bind = op.get_bind()
    models = bind.execute(sa.text(
        "SELECT DISTINCT queue FROM jobs UNION SELECT DISTINCT queue FROM job_tallies"
        " UNION SELECT DISTINCT queue FROM metric_counts WHERE queue <> ''")).scalars().all()
    prefixes = {lane.rpartition(SEPARATOR)[0] for lane in models}
    if len(prefixes) > 1:
        raise ValueError(f"cannot downgrade: jobs of {len(prefixes)} models ({', '.join(sorted(prefixes))}) "
                         "would share their queues")
    for table, where in PER_QUEUE.items():
        for prefix in prefixes:
            bind.execute(sa.text(f"UPDATE {table} SET queue = substr(queue, :start) WHERE 1 = 1{where}"),
                         {"start": len(prefix) + len(SEPARATOR) + 1})
    bind.execute(sa.text("UPDATE jobs SET dispatched_at = NULL WHERE status = 'queued'"))
