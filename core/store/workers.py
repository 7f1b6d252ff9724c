"""Worker registry: each worker process registers, beats, and marks itself stopped.

The reconciler uses it to find the running jobs of dead workers (to requeue them); /v1/queues, /v1/scaling
and the metrics use it to say how many live workers consume each queue. A beat also carries the worker's
engine pace (engine/pace.py: seconds per step and per prompt token), from which submit predicts how long a
job will run (core/store/finish_times.py).
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta

from sqlalchemy import bindparam, delete, select, text, update
from sqlalchemy.orm import Session

from conveyor.core.lanes import LANE_SEPARATOR, model_of
from conveyor.core.lifecycle import RUNNING
from conveyor.core.store.database import postgres_session_name
from conveyor.core.store.tables import Job, Worker


def register(
    session: Session, worker_id: str, *, hostname: str, pid: int, queues: list[str], now: datetime
) -> None:
    session.merge(Worker(id=worker_id, hostname=hostname, pid=pid, queues=queues, started_at=now,
                         last_seen_at=now, stopped_at=None))
    session.commit()


def heartbeat(session: Session, worker_id: str, now: datetime, pace: dict[str, float] | None = None) -> bool:
    """False when the worker is unknown or already marked stopped. `pace`: its engine's, when measured."""
    values: dict[str, object] = {"last_seen_at": now}
    if pace is not None:
        values["rates"] = pace
    statement = update(Worker).where(Worker.id == worker_id, Worker.stopped_at.is_(None)).values(**values)
    result = session.execute(statement.execution_options(synchronize_session=False))
    session.commit()
    applied: bool = result.rowcount == 1  # type: ignore[attr-defined]
    return applied


def mark_stopped(session: Session, worker_id: str, now: datetime) -> None:
    statement = update(Worker).where(Worker.id == worker_id).values(stopped_at=now, last_seen_at=now)
    session.execute(statement.execution_options(synchronize_session=False))
    session.commit()


def recent(session: Session, limit: int) -> list[Worker]:
    """The workers heard from last, first (live, silent and stopped alike, until pruned)."""
    return list(session.execute(select(Worker).order_by(Worker.last_seen_at.desc()).limit(limit)).scalars())


def live_workers(session: Session, *, now: datetime, dead_after_s: float) -> list[Worker]:
    """Workers not stopped whose last heartbeat is recent."""
    cutoff = now - timedelta(seconds=dead_after_s)
    query = select(Worker).where(Worker.stopped_at.is_(None), Worker.last_seen_at >= cutoff)
    return list(session.execute(query.order_by(Worker.started_at)).scalars())


def live_workers_per_queue(session: Session, *, now: datetime, dead_after_s: float) -> dict[str, int]:
    """How many live workers (as in live_workers) consume each queue; a queue nobody consumes is absent.
    Reads the queue lists only: the scaling signal asks this on every poll."""
    counts: Counter[str] = Counter()
    for queues in _live_queue_lists(session, now, dead_after_s):
        counts.update(set(queues))  # a worker listing a queue twice is still one consumer
    return dict(counts)


def live_workers_per_model(session: Session, *, now: datetime, dead_after_s: float) -> dict[str, int]:
    """How many live workers serve each model (the models of the lanes they consume, core/lanes.py)."""
    counts: Counter[str] = Counter()
    for lanes in _live_queue_lists(session, now, dead_after_s):
        counts.update({model_of(lane) for lane in lanes if LANE_SEPARATOR in lane})
    return dict(counts)


def _live_queue_lists(session: Session, now: datetime, dead_after_s: float) -> list[list[str]]:
    cutoff = now - timedelta(seconds=dead_after_s)
    query = select(Worker.queues).where(Worker.stopped_at.is_(None), Worker.last_seen_at >= cutoff)
    return list(session.execute(query).scalars())


def paces(session: Session, queue: str, *, now: datetime, dead_after_s: float) -> list[dict[str, float]]:
    """The paces published by the live workers consuming `queue` (those that measured one)."""
    cutoff = now - timedelta(seconds=dead_after_s)
    query = select(Worker.queues, Worker.rates).where(
        Worker.stopped_at.is_(None), Worker.last_seen_at >= cutoff, Worker.rates.is_not(None))
    return [rates for queues, rates in session.execute(query) if queue in queues and rates]


def dead_workers_with_jobs(session: Session, *, now: datetime, dead_after_s: float) -> list[str]:
    """Workers holding running jobs that are not alive: stopped, silent too long, or never registered."""
    cutoff = now - timedelta(seconds=dead_after_s)
    alive = select(Worker.id).where(Worker.stopped_at.is_(None), Worker.last_seen_at >= cutoff)
    query = (
        select(Job.worker_id)
        .where(Job.status == RUNNING, Job.worker_id.is_not(None), Job.worker_id.not_in(alive))
        .distinct()
    )
    return [worker_id for worker_id in session.execute(query).scalars() if worker_id is not None]


_END_IDLE_TRANSACTIONS = text(
    "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity"
    " WHERE application_name IN :names AND state LIKE 'idle in transaction%'"
    " AND usename = current_user AND pid <> pg_backend_pid()"
).bindparams(bindparam("names", expanding=True))


def end_idle_transactions(session: Session, worker_ids: list[str]) -> int:
    """PostgreSQL: ends the sessions of dead workers (named by `make_db_engine(session_name=...)`) that sit
    idle inside a transaction. A worker frozen mid-write (SIGSTOP, a paused VM) holds its rows' locks for as
    long as it stays frozen, and the sweeps skip locked rows (core/store/jobs/transitions.py `unlocked`), so
    without this its jobs would stay `running` until it woke. Only sessions of this database role can be
    ended. The server ends them asynchronously: their rows are free for the next sweep. Returns how many were
    signalled."""
    if not worker_ids or session.get_bind().dialect.name != "postgresql":
        return 0
    names = sorted({postgres_session_name(worker_id) for worker_id in worker_ids})
    return int(session.execute(_END_IDLE_TRANSACTIONS, {"names": names}).scalar_one())


def prune(session: Session, *, now: datetime, older_than_s: float) -> int:
    """Deletes the rows of workers stopped or silent for `older_than_s` that hold no running job (the
    reconciler requeues those first); commits. Returns how many went."""
    cutoff = now - timedelta(seconds=older_than_s)
    holding = select(Job.worker_id).where(Job.status == RUNNING, Job.worker_id.is_not(None))
    statement = delete(Worker).where(Worker.last_seen_at < cutoff, Worker.id.not_in(holding))
    result = session.execute(statement.execution_options(synchronize_session=False))
    session.commit()
    return int(result.rowcount)  # type: ignore[attr-defined]
