"""The fault suite's view of its store: the jobs, workers and deliveries as the database has them, and the
poll every wait of the suite uses (database errors count as "not yet": the server may be restarting)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from sqlalchemy import create_engine, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker

from conveyor.core.store.tables import DEFAULT_TENANT, Base, Delivery, Job, Tenant, Worker

POLL_S = 0.25  # how often the suite reads the database while waiting: frugal on a shared 2-core machine
# Bounds on the suite's waits, generous on purpose: CI's 2-core machine, shared with the rest of the parallel
# suite and with its host's other tenants, has run the fault model six times slower than a quiet run does
# (4 x 2,000 tokens took over 60 s). The tests poll, so a bound costs time only when a test fails.
WAIT_S = 180.0  # one step of a test: jobs start generating, a worker finishes its first job, traffic goes on
SETTLE_S = 300.0  # every accepted job to reach its final state once a fault is over


def store_engine(url: str) -> Engine:
    return create_engine(url, pool_pre_ping=True, pool_size=2, max_overflow=2)


def empty_store(db: Engine) -> None:
    """Every row of every table, children first; the `default` tenant (made by the migrations) stays."""
    with db.begin() as conn:
        for table in reversed(Base.metadata.sorted_tables):
            query = table.delete()
            if table.name == Tenant.__tablename__:
                query = query.where(table.c.id != DEFAULT_TENANT)
            conn.execute(query)


class Store:
    """Read-only queries the tests make (plus the webhook subscription each test starts with)."""

    def __init__(self, db: Engine) -> None:
        self.db = db
        self.sessions = sessionmaker(bind=db, expire_on_commit=False)

    def jobs(self, ids: Iterable[str] | None = None) -> dict[str, Job]:
        query = select(Job)
        if ids is not None:
            query = query.where(Job.id.in_(list(ids)))
        with self.sessions() as session:
            return {job.id: job for job in session.execute(query).scalars()}

    def job(self, job_id: str) -> Job:
        found = self.jobs([job_id])
        assert job_id in found, f"job {job_id} is not in the store"
        return found[job_id]

    def workers(self) -> list[Worker]:
        with self.sessions() as session:
            return list(session.execute(select(Worker)).scalars())

    def worker_id_of_pid(self, pid: int) -> str | None:
        for worker in self.workers():
            if worker.pid == pid and worker.stopped_at is None:
                return worker.id
        return None

    def job_deliveries(self) -> dict[str, list[Delivery]]:
        with self.sessions() as session:
            rows = session.execute(select(Delivery).where(Delivery.subject_type == "job")).scalars()
            out: dict[str, list[Delivery]] = {}
            for row in rows:
                out.setdefault(row.subject_id, []).append(row)
        return out

    def subscribe(self, url: str) -> None:
        """One subscription to every job event of the default tenant: each final transition of a job then
        leaves exactly one delivery row, written in the transition's own transaction."""
        from conveyor.core.clock import utcnow
        from conveyor.core.store import webhooks

        with self.sessions() as session:
            webhooks.create_subscription(session, DEFAULT_TENANT, url, ["job.*"], "fault suite", utcnow())



def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float, *,
               also: Callable[[], None] | None = None, poll_s: float = POLL_S,
               describe: Callable[[], str] | None = None) -> None:
    """Polls `predicate` (and `also`, which may raise to fail early) until true; AssertionError after
    timeout_s, with what `describe` says of the state then. Database errors count as 'not yet' (a test may
    be waiting for a restarted server)."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while True:
        if also is not None:
            also()
        try:
            if predicate():
                return
            last_error = None
        except AssertionError:
            raise
        except Exception as exc:
            last_error = exc
        if time.monotonic() > deadline:
            detail = f" (last error: {type(last_error).__name__}: {last_error})" if last_error else ""
            if describe is not None:
                detail += f"; now: {describe()}"
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}{detail}")
        time.sleep(poll_s)
