"""The store-scale bench's data (`conveyor bench-store`, cli/store_bench.py): a PostgreSQL database emptied
and filled by plain SQL bulk inserts (`INSERT ... SELECT generate_series`), in the shape of real rows.

- `tenants` bench tenants (`bench-t000`, ...), limits left to the settings, each with one open batch;
- `queued` jobs in one queue, round robin over the tenants, created over the last hour, all dispatched, none
  expiring for a day: one in 10 a batch line, one in 5 with a deadline two hours ahead (a service tier,
  `start_by`), one in 20 flex work (priority 1), a third with an Idempotency-Key, a quarter with metadata;
- RUNNING jobs held by the bench's worker (`WORKER_ID`, registered live by the bench while it times);
- `history` finished jobs over the last 7 days (the newest a minute ago), six in seven of them in the bench's
  queue and the rest in `documents`: 90 % succeeded, 5 % failed, 3 % cancelled, 2 % expired, with their
  times, tokens, answer, error, worker, batch and deadline columns set as a worker and the reconciler set
  them.
Then VACUUM ANALYZE: statistics for the planner, and the visibility map a long-running database has (a
freshly loaded table has none, so index-only scans would read the heap; and autovacuum would otherwise start
on the new rows in the middle of the timings).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime

from sqlalchemy import Engine, TextClause, inspect, text
from sqlalchemy.orm import Session

from conveyor.core.lanes import lane_of, model_of, queue_of
from conveyor.core.metric_buckets import LATENCY_BUCKETS_S
from conveyor.core.store import job_tallies
from conveyor.core.store.outcome_counts import INF_LABEL

TENANT_PREFIX = "bench-t"
WORKER_ID = "bench-worker"
RUNNING = 32  # jobs a live fleet holds while the bench times
CHUNK_ROWS = 250_000  # rows per INSERT (one transaction each, a progress line each)
HISTORY_QUEUE_SHARE = 7  # one finished job in 7 is of the `documents` queue, the rest of the bench's queue
OTHER_QUEUE = "documents"

BUCKET_LABELS = [repr(bound) for bound in LATENCY_BUCKETS_S] + [INF_LABEL]  # outcome_counts.bucket_label's

Progress = Callable[[str], None]

_TENANT = f"'{TENANT_PREFIX}' || lpad((i % :tenants)::text, 3, '0')"
_BATCH = "'batch_bench_' || lpad((i % :tenants)::text, 3, '0')"

_RESET = text("TRUNCATE jobs, batch_lines, batches, metric_counts, workers, webhook_deliveries, "
              "webhook_attempts, job_tallies, job_tally_deltas, broker_republish")  # fires no row trigger

_TENANTS = text(f"""
INSERT INTO tenants (id, created_at)
SELECT {_TENANT}, :now - interval '30 days' FROM generate_series(0, :tenants - 1) AS i
ON CONFLICT (id) DO NOTHING
""")

_BATCHES = text(f"""
INSERT INTO batches (id, tenant_id, endpoint, input_url, queue, completion_window, status, total, completed,
                     failed, cancelled, prompt_tokens, completion_tokens, read_line, read_offset, read_done,
                     failure_count, created_at, in_progress_at, updated_at)
SELECT {_BATCH}, {_TENANT}, '/v1/chat/completions', 'file://bench/input.jsonl', :batch_queue, '24h',
       'in_progress', 0, 0, 0, 0, 0, 0, 1, 0, false, 0, :now - interval '8 days', :now - interval '8 days',
       :now
FROM generate_series(0, :tenants - 1) AS i
""")

# The outcome counters the history's jobs would have left (what /metrics reads): a bounded table.
_METRIC_COUNTS = text("""
INSERT INTO metric_counts (metric, queue, status, label, count, total)
SELECT metric, queue, status, label, 1000, 500.0
FROM unnest(ARRAY['job_queue_time_seconds', 'job_time_to_first_token_seconds', 'job_e2e_seconds']) AS metric,
     unnest(ARRAY[CAST(:queue AS text), CAST(:other AS text)]) AS queue,
     unnest(ARRAY['succeeded', 'failed', 'cancelled', 'expired']) AS status,
     unnest(CAST(:labels AS text[])) AS label
""")

# One row per i in [lo, hi] of 1..n; `created` spreads them oldest (i = 1) to newest (i = n).
_QUEUED = text(f"""
INSERT INTO jobs (id, tenant_id, queue, status, prompt, params, metadata, idempotency_key, request_hash,
                  ttl_s, expires_at, created_at, attempts, preemptions, prompt_tokens, dispatched_at,
                  updated_at, priority, deadline_at, start_by, service_tier, batch_id)
SELECT 'job_' || md5('q' || i), {_TENANT}, :queue, 'queued',
       'Summarize the attached report in three sentences, for reader ' || i || '.',
       json_build_object('max_tokens', 16 + (i % 16) * 16, 'temperature', 0.7),
       CASE WHEN i % 4 = 0 THEN json_build_object('source', 'bench', 'n', i) END,
       CASE WHEN i % 3 = 0 THEN 'idem-q-' || i END,
       md5('h' || i) || md5('H' || i), 86400.0, created + interval '1 day', created, 0, 0, 20 + i % 500,
       created + interval '5 milliseconds', created,
       CASE WHEN i % 20 = 7 THEN 1 ELSE 0 END,
       CASE WHEN i % 5 = 1 THEN created + interval '2 hours' END,
       CASE WHEN i % 5 = 1 THEN created + interval '2 hours' - interval '10 seconds' END,
       CASE WHEN i % 20 = 7 THEN 'flex' WHEN i % 5 = 1 THEN 'default' END,
       CASE WHEN i % 10 = 0 THEN {_BATCH} END
FROM (SELECT i, :now - interval '1 hour' * ((:n - i)::float8 / :n) AS created
      FROM generate_series(CAST(:lo AS int), CAST(:hi AS int)) AS i) AS g
""")

_RUNNING = text(f"""
INSERT INTO jobs (id, tenant_id, queue, status, prompt, params, request_hash, ttl_s, expires_at, created_at,
                  started_at, attempts, preemptions, prompt_tokens, worker_id, dispatched_at, updated_at,
                  priority)
SELECT 'job_' || md5('r' || i), {_TENANT}, :queue, 'running', 'A running prompt ' || i,
       json_build_object('max_tokens', 128), md5('r' || i) || md5('R' || i), 86400.0,
       :now + interval '1 day', :now - interval '1 minute', :now - interval '30 seconds', 1, 0, 40,
       :worker, :now - interval '1 minute', :now - interval '30 seconds', 0
FROM generate_series(1, :running) AS i
""")

# i % 100: < 90 succeeded, < 95 failed, < 98 cancelled (half of them while running), else expired.
_HISTORY = text(f"""
INSERT INTO jobs (id, tenant_id, queue, status, prompt, params, metadata, idempotency_key, request_hash,
                  ttl_s, expires_at, created_at, started_at, first_token_at, finished_at, attempts,
                  preemptions, result_text, finish_reason, prompt_tokens, completion_tokens, cached_tokens,
                  error_code, error_message, worker_id, dispatched_at, updated_at, priority, deadline_at,
                  start_by, service_tier, batch_id)
SELECT 'job_' || md5('f' || i), {_TENANT}, queue, status,
       'Summarize the attached report in three sentences, for reader ' || i || '.',
       json_build_object('max_tokens', 16 + (i % 16) * 16, 'temperature', 0.7),
       CASE WHEN i % 4 = 0 THEN json_build_object('source', 'bench', 'n', i) END,
       CASE WHEN i % 3 = 0 THEN 'idem-f-' || i END,
       md5('f' || i) || md5('F' || i), 600.0, created + interval '10 minutes', created,
       started, CASE WHEN status = 'succeeded' THEN started + interval '200 milliseconds' END,
       CASE WHEN status = 'expired' THEN created + interval '10 minutes'
            ELSE coalesce(started, created) + tokens * interval '20 milliseconds' END,
       CASE WHEN started IS NULL THEN 0 ELSE 1 END, CASE WHEN i % 50 = 0 THEN 1 ELSE 0 END,
       CASE WHEN status = 'succeeded'
            THEN 'The report finds that ' || i || ' shipments arrived late; most delays came from customs, '
                 || 'and the new carrier halved them within a quarter.' END,
       CASE WHEN status = 'succeeded' THEN CASE WHEN i % 3 = 0 THEN 'length' ELSE 'stop' END END,
       20 + i % 500, CASE WHEN status = 'succeeded' THEN tokens END,
       CASE WHEN status = 'succeeded' THEN (i % 4) * 16 END,
       CASE status WHEN 'failed' THEN 'engine_error' WHEN 'cancelled' THEN 'cancelled'
                   WHEN 'expired' THEN 'expired' END,
       CASE status WHEN 'failed' THEN 'the engine failed: out of memory'
                   WHEN 'cancelled' THEN 'cancelled by the client'
                   WHEN 'expired' THEN 'ttl passed before the job started' END,
       CASE WHEN started IS NOT NULL THEN 'bench-old-worker-' || i % 4 END,
       created + interval '5 milliseconds',
       CASE WHEN status = 'expired' THEN created + interval '10 minutes'
            ELSE coalesce(started, created) + tokens * interval '20 milliseconds' END,
       0, CASE WHEN i % 5 = 1 THEN created + interval '1 minute' END,
       CASE WHEN i % 5 = 1 THEN created + interval '50 seconds' END,
       CASE WHEN i % 5 = 1 THEN 'default' END,
       CASE WHEN i % 10 = 0 THEN {_BATCH} END
FROM (SELECT i, created, status, tokens,
             CASE WHEN status IN ('succeeded', 'failed') OR (status = 'cancelled' AND i % 2 = 0)
                  THEN created + interval '2 seconds' END AS started,
             CASE WHEN i % :share = 0 THEN :other ELSE :queue END AS queue
      FROM (SELECT i, :now - interval '1 minute' - interval '7 days' * ((:n - i)::float8 / :n) AS created,
                   CASE WHEN i % 100 < 90 THEN 'succeeded' WHEN i % 100 < 95 THEN 'failed'
                        WHEN i % 100 < 98 THEN 'cancelled' ELSE 'expired' END AS status,
                   1 + i % 256 AS tokens
            FROM generate_series(CAST(:lo AS int), CAST(:hi AS int)) AS i) AS s) AS g
""")


def fill(db_engine: Engine, *, queued: int, history: int, tenants: int, queue: str, now: datetime,
         progress: Progress) -> float:
    """Empties the bench's tables and fills them (the module docstring); returns the seconds it took,
    VACUUM ANALYZE included. `queue`: a lane (core/lanes.py); the other lane is its model's OTHER_QUEUE."""
    start = time.perf_counter()
    other = lane_of(model_of(queue), OTHER_QUEUE)
    shape = {"tenants": tenants, "queue": queue, "other": other, "batch_queue": queue_of(queue), "now": now}
    with db_engine.begin() as conn:
        conn.execute(_RESET)
        conn.execute(_TENANTS, shape)
        conn.execute(_BATCHES, shape)
        conn.execute(_RUNNING, {**shape, "running": RUNNING, "worker": WORKER_ID})
        conn.execute(_METRIC_COUNTS, {**shape, "labels": BUCKET_LABELS})
    _insert_chunks(db_engine, _QUEUED, queued, shape, "queued", progress)
    _insert_chunks(db_engine, _HISTORY, history, {**shape, "share": HISTORY_QUEUE_SHARE}, "history", progress)
    with Session(db_engine) as session:
        job_tallies.fold(session)  # as a running service's reconciler would have
    progress("VACUUM ANALYZE")
    with db_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE"))
    return time.perf_counter() - start


def _insert_chunks(db_engine: Engine, statement: TextClause, rows: int, shape: dict[str, object], what: str,
                   progress: Progress) -> None:
    for lo in range(1, rows + 1, CHUNK_ROWS):
        hi = min(rows, lo + CHUNK_ROWS - 1)
        with db_engine.begin() as conn:
            conn.execute(statement, {**shape, "n": rows, "lo": lo, "hi": hi})
        progress(f"{what}: {hi} of {rows} rows")


def foreign_rows(db_engine: Engine) -> bool:
    """Whether the database holds jobs of tenants other than the bench's: not a database to empty."""
    if not inspect(db_engine).has_table("jobs"):
        return False
    query = text("SELECT EXISTS (SELECT 1 FROM jobs WHERE tenant_id NOT LIKE :prefix)")
    with db_engine.connect() as conn:
        return bool(conn.execute(query, {"prefix": TENANT_PREFIX + "%"}).scalar_one())
