"""Cluster-wide outcome counters in the `metric_counts` table: what the API's /metrics reports per queue and
final status, counted once whichever process makes the outcome final.

Written inside the transaction of the final transition (record_finished) or of the webhook attempt, so a
transition that lost a race counts nothing and a committed one counts exactly once. Every API process reads
the same rows: scraped several times, they report the same global value (aggregate with max(), not sum()).
Rows are upserted in a fixed key order, so concurrent finishes wait on each other's rows, never deadlock.

Series (`metric` column; histograms keep one non-cumulative row per bucket, `label` its upper bound):
- job_queue_time_seconds, job_time_to_first_token_seconds, job_e2e_seconds: per queue and final status;
- jobs_finished: per queue and final status, jobs that reached it (`total`: their engine preemptions), so
  /metrics never counts the jobs table (migration 0014 counted the jobs already final);
- job_failures: per queue and error code (failed and expired jobs);
- job_deadlines: per queue, tier and deadline outcome, for jobs that had a deadline: on_time (succeeded by
  it), late (succeeded after it), missed (ended otherwise: failed, expired or cancelled). The `status`
  column holds the job's goodput tier (core/protocol/service_tiers.py goodput_tier); rows written before tiers
  were counted have "", read as the default tier (`row_tier`);
- job_lateness_seconds: per queue and final status, how far past its deadline a job ended (late and missed
  jobs whose deadline had passed);
- batch_lines: per queue and line outcome (lines whose job finished);
- webhook_deliveries: per attempt outcome (delivered, retry, failed, disabled).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Insert, Row, and_, case, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from conveyor.core.lifecycle import EXPIRED, FAILED, LINE_OUTCOME, SUCCEEDED
from conveyor.core.metric_buckets import LATENCY_BUCKETS_S
from conveyor.core.protocol.service_tiers import goodput_tier
from conveyor.core.store.tables import BatchLine, Job, MetricCount

QUEUE_TIME, TTFT, E2E = "job_queue_time_seconds", "job_time_to_first_token_seconds", "job_e2e_seconds"
LATENESS = "job_lateness_seconds"
HISTOGRAMS = (QUEUE_TIME, TTFT, E2E, LATENESS)
JOB_FAILURES, BATCH_LINES, WEBHOOK_DELIVERIES = "job_failures", "batch_lines", "webhook_deliveries"
JOB_DEADLINES = "job_deadlines"
JOBS_FINISHED = "jobs_finished"
ON_TIME, LATE, MISSED = "on_time", "late", "missed"
INF_LABEL = "+Inf"

Key = tuple[str, str, str, str]  # (metric, queue, status, label)


@dataclass
class Increment:
    count: int = 0
    total: float = 0.0


def bucket_label(seconds: float) -> str:
    """The upper bound of the smallest bucket holding `seconds`, as Prometheus writes it ("+Inf" past the
    last)."""
    i = bisect.bisect_left(LATENCY_BUCKETS_S, seconds)
    return repr(LATENCY_BUCKETS_S[i]) if i < len(LATENCY_BUCKETS_S) else INF_LABEL


def record_finished_jobs(session: Session, finished: Sequence[Row[Any]], of_batches: list[str],
                         status: str) -> None:
    """Counts jobs that just reached `status` (inside their transition's transaction, after its UPDATE):
    `finished`, their rows (final_status_effects.FINISHED_COLUMNS); `of_batches`, the ids of those of a
    batch."""
    increments: dict[Key, Increment] = {}
    for row in finished:
        _count_job(increments, row, status)
    if of_batches:
        _count_batch_lines(session, of_batches, status, increments)
    _upsert(session, increments)


def _count_job(increments: dict[Key, Increment], row: Row[Any], status: str) -> None:
    """One finished job's increments: its count and preemptions, its deadline outcome, its latencies, its
    failure code."""
    queue, created = row.queue, due_since(row.created_at, row.run_at)
    end = row.finished_at or created
    finished_jobs = increments.setdefault((JOBS_FINISHED, queue, status, ""), Increment())
    finished_jobs.count += 1
    finished_jobs.total += row.preemptions or 0
    if row.deadline_at is not None:
        _count_deadline(increments, queue, goodput_tier(row.service_tier), status, end, row.deadline_at)
    _observe(increments, (QUEUE_TIME, queue, status), _seconds(created, row.started_at or end))
    _observe(increments, (E2E, queue, status), _seconds(created, end))
    if row.first_token_at is not None:
        _observe(increments, (TTFT, queue, status), _seconds(created, row.first_token_at))
    if status in (FAILED, EXPIRED):
        _count(increments, (JOB_FAILURES, queue, "", row.error_code or "unknown"), 1)


def due_since(created_at: datetime, run_at: datetime | None) -> datetime:
    """Where a job's latencies count from: when it was last due (its run_at: scheduled, or retried), else its
    submission."""
    return run_at if run_at is not None and run_at > created_at else created_at


def deadline_outcome(status: str, end: datetime, deadline: datetime) -> str:
    """on_time, late or missed: whether a job with a deadline delivered by it."""
    if status != SUCCEEDED:
        return MISSED
    return ON_TIME if end <= deadline else LATE


def deadline_outcome_sql() -> ColumnElement[str]:
    """`deadline_outcome` as a SQL expression over a finished job's row (for counts read from the jobs
    table): the same rule, in one place."""
    return case((and_(Job.status == SUCCEEDED, Job.finished_at <= Job.deadline_at), ON_TIME),
                (Job.status == SUCCEEDED, LATE), else_=MISSED)


def row_tier(status_column: str) -> str:
    """The goodput tier of a job_deadlines row (its `status` column): "" (written before tiers were counted)
    is the default tier."""
    return goodput_tier(status_column or None)


def _count_deadline(increments: dict[Key, Increment], queue: str, tier: str, status: str, end: datetime,
                    deadline: datetime) -> None:
    _count(increments, (JOB_DEADLINES, queue, tier, deadline_outcome(status, end, deadline)), 1)
    if end > deadline:
        _observe(increments, (LATENESS, queue, status), _seconds(deadline, end))


def record_webhook_attempt(session: Session, outcome: str) -> None:
    """Counts one webhook attempt's outcome (inside the transaction that stores the attempt)."""
    _upsert(session, {(WEBHOOK_DELIVERIES, "", "", outcome): Increment(1, 0.0)})


def all_counts(session: Session) -> list[MetricCount]:
    """Every series: a bounded table (metrics x queues x statuses x buckets or codes), read in one query."""
    return list(session.scalars(select(MetricCount)))


def _count_batch_lines(
    session: Session, job_ids: list[str], status: str, increments: dict[Key, Increment]
) -> None:
    rows = session.execute(
        select(Job.queue, func.count())
        .join(BatchLine, BatchLine.job_id == Job.id)
        .where(Job.id.in_(job_ids))
        .group_by(Job.queue)
    ).all()
    for queue, n in rows:
        _count(increments, (BATCH_LINES, queue, "", LINE_OUTCOME[status]), n)


def _seconds(start: datetime, end: datetime) -> float:
    return max(0.0, (end - start).total_seconds())


def _observe(increments: dict[Key, Increment], series: tuple[str, str, str], seconds: float) -> None:
    inc = increments.setdefault((*series, bucket_label(seconds)), Increment())
    inc.count += 1
    inc.total += seconds


def _count(increments: dict[Key, Increment], key: Key, n: int) -> None:
    increments.setdefault(key, Increment()).count += n


def _upsert(session: Session, increments: dict[Key, Increment]) -> None:
    """One statement, executed once per row in a fixed lock order (building a statement per row cost more
    CPU than the database spent on all of them)."""
    if not increments:
        return
    rows = [{"metric": metric, "queue": queue, "status": status, "label": label, "count": inc.count,
             "total": inc.total} for (metric, queue, status, label), inc in sorted(increments.items())]
    session.connection().execute(_upsert_statement(session.get_bind().dialect.name), rows)


@functools.cache
def _upsert_statement(dialect: str) -> Insert:
    """The upsert of one row's increments, built once per dialect (building it cost more than running it)."""
    statement = (pg_insert if dialect == "postgresql" else sqlite_insert)(MetricCount.__table__)
    table = MetricCount.__table__
    return statement.on_conflict_do_update(
        index_elements=["metric", "queue", "status", "label"],
        set_={"count": table.c.count + statement.excluded.count,
              "total": table.c.total + statement.excluded.total},
    )


def series_of(rows: Iterable[MetricCount], metric: str) -> list[MetricCount]:
    return [row for row in rows if row.metric == metric]
