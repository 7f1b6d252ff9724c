"""The store operations `conveyor bench-store` times (cli/store_bench.py): every store call on a job's way
through the service, and every one a worker, its reconciler or a scrape makes per round, each through the
project's own functions.

An operation that changes rows is undone after each timed run (`undo`, untimed), or runs on rows made for
it (`prepare`, untimed), so every run meets the same data: a claim's jobs are queued again, a submitted job
deleted, the jobs a step's writes finish are made running before and queued again after.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, delete, select, update
from sqlalchemy.orm import Session, sessionmaker

from conveyor.api.metrics import StoreCollector
from conveyor.api.routes.queues import GOODPUT_WINDOW
from conveyor.cli.store_fill import WORKER_ID
from conveyor.cli.store_plans import Statement, captured_statements
from conveyor.core.clock import utcnow
from conveyor.core.lifecycle import QUEUED, RUNNING
from conveyor.core.protocol.job_params import JobParams
from conveyor.core.seams.dispatch import publish_and_mark
from conveyor.core.settings import Settings
from conveyor.core.store import (
    finish_times,
    job_tallies,
    jobs,
    outcome_counts,
    republish_walk,
    tenants,
    token_usage,
    workers,
)
from conveyor.core.store.fair_share import FairState, claim_fair
from conveyor.core.store.tables import BrokerRepublish, Job
from conveyor.core.store.tenants import TenantLimits
from conveyor.worker.reconciler import REDISPATCH_BATCH, Reconciler

RETENTION_DAYS = 30  # the purge's retention: longer than the history, so a purge round deletes nothing
CLAIM = 16  # jobs per claim, per step's writes, per dispatch group: a worker's usual batch
PACE = {"step_s": 0.02, "prefill_token_s": 0.0002}  # the bench worker's published engine pace
ANSWER = "The report finds that most shipments arrived late, held at customs; the new carrier halved it."
SPARE = 40  # queued jobs set aside for the per-job writes (the newest, without batch or deadline)


@dataclass
class Bench:
    """What the operations run against: the filled database, its settings and the rows set aside."""

    db_engine: Engine
    sessions: sessionmaker[Session]
    settings: Settings
    queue: str
    tenant: str  # the tenant of the per-tenant operations
    spare: list[tuple[str, str]]  # (job id, tenant): queued jobs the per-job writes change and restore
    running: list[str]  # jobs the bench worker runs
    idempotent: tuple[str, str]  # (tenant, Idempotency-Key) of a stored job
    memo: dict[str, Any] = field(default_factory=dict)

    @property
    def defaults(self) -> TenantLimits:
        return TenantLimits.defaults(self.settings)

    def spare_ids(self, start: int, stop: int) -> list[str]:
        return [job_id for job_id, _ in self.spare[start:stop]]


@dataclass(frozen=True)
class Operation:
    name: str
    path: str  # where it runs: worker claim, worker step, worker round, submit, API read
    run: Callable[[Bench, Any], object]  # timed; gets what `prepare` returned
    prepare: Callable[[Bench], Any] | None = None  # untimed, before each run
    undo: Callable[[Bench, Any, Any], None] | None = None  # untimed, after each: (bench, prepared, result)


def open_bench(db_engine: Engine, sessions: sessionmaker[Session], settings: Settings, queue: str,
               tenant: str) -> Bench:
    """Registers the bench worker (live, with a pace) and sets aside the rows the operations use."""
    now = utcnow()
    with sessions() as session:
        workers.register(session, WORKER_ID, hostname="bench", pid=0, queues=settings.lanes(), now=now)
        workers.heartbeat(session, WORKER_ID, now, PACE)
        spare = session.execute(
            select(Job.id, Job.tenant_id)
            .where(Job.status == QUEUED, Job.queue == queue, Job.batch_id.is_(None),
                   Job.deadline_at.is_(None))
            .order_by(Job.created_at.desc()).limit(SPARE)).all()
        running = session.execute(select(Job.id).where(Job.status == RUNNING, Job.worker_id == WORKER_ID)
                                  .order_by(Job.id).limit(CLAIM)).scalars().all()
        idempotent = session.execute(select(Job.tenant_id, Job.idempotency_key)
                                     .where(Job.idempotency_key.is_not(None)).limit(1)).one()
    if len(spare) < SPARE:
        raise ValueError(f"the bench needs {SPARE} queued jobs without batch or deadline; found {len(spare)}")
    return Bench(db_engine, sessions, settings, queue, tenant, [(i, t) for i, t in spare], list(running),
                 (idempotent[0], idempotent[1]))


# --- keeping the data the same between runs ------------------------------------------------------------


def requeue(bench: Bench, job_ids: list[str]) -> None:
    """Jobs made running or final by a timed run, queued again as they were (never started)."""
    if not job_ids:
        return
    with bench.sessions() as session:
        session.execute(update(Job).where(Job.id.in_(job_ids)).values(
            status=QUEUED, attempts=0, preemptions=0, started_at=None, first_token_at=None, finished_at=None,
            worker_id=None, result_text=None, finish_reason=None, completion_tokens=None, cached_tokens=None,
            draft_tokens=None, accepted_draft_tokens=None,
            error_code=None, error_message=None, updated_at=Job.created_at))
        session.commit()


def make_running(bench: Bench, job_ids: list[str], *, first_token: bool) -> list[str]:
    """Queued jobs claimed by the bench worker (attempt 1), as a step finds them."""
    now = utcnow()
    with bench.sessions() as session:
        session.execute(update(Job).where(Job.id.in_(job_ids)).values(
            status=RUNNING, attempts=1, started_at=now, worker_id=WORKER_ID, updated_at=now,
            first_token_at=now if first_token else None))
        session.commit()
    return job_ids


def _delete(bench: Bench, job_id: str) -> None:
    with bench.sessions() as session:
        session.execute(delete(Job).where(Job.id == job_id))
        session.commit()


def _undo_requeue(bench: Bench, _prepared: Any, job_ids: Any) -> None:
    requeue(bench, list(job_ids))


def _undo_prepared(bench: Bench, job_ids: Any, _result: Any) -> None:
    requeue(bench, list(job_ids))


# --- the worker's claim --------------------------------------------------------------------------------


def fair_claim(bench: Bench, _prepared: Any = None) -> list[str]:
    """A worker's claim of CLAIM jobs in fair order, reading the whole queue's backlog (a fresh view)."""
    with bench.sessions() as session:
        claimed = claim_fair(session, bench.queue, CLAIM, WORKER_ID, utcnow, bench.defaults,
                             FairState(view_s=0))
    return [job.id for job in claimed]


def claim_statements(bench: Bench) -> list[Statement]:
    """The statements of one fair claim (run once and undone, then remembered)."""
    if "claim" not in bench.memo:
        with captured_statements(bench.db_engine) as statements:
            claimed = fair_claim(bench)
        requeue(bench, claimed)
        bench.memo["claim"] = statements
    return list(bench.memo["claim"])


def _claim_statement(bench: Bench, matches: Callable[[Statement], bool], what: str) -> Statement:
    found = [statement for statement in claim_statements(bench) if matches(statement)]
    if not found:
        raise LookupError(f"no {what} among the fair claim's statements")
    return found[0]


def _is_tenant_select(statement: Statement) -> bool:
    """A stream's read of its next jobs (queued_streams.most_urgent: one statement of locking CTEs)."""
    sql = statement.sql.upper().lstrip()
    return sql.startswith(("SELECT", "WITH")) and "SKIP LOCKED" in sql and not _is_backlog_read(statement)


def _is_backlog_read(statement: Statement) -> bool:
    """The read of every stream's queued jobs: core/store/queued_streams.py's skip scan (before it, a GROUP
    BY over the queued rows)."""
    return "QUEUED_TENANTS" in statement.sql.upper()


def _tenant_select(bench: Bench) -> Statement:
    return _claim_statement(bench, _is_tenant_select, "SELECT ... FOR UPDATE SKIP LOCKED")


def _backlog_read(bench: Bench) -> Statement:
    return _claim_statement(bench, _is_backlog_read, "grouped read of the queued jobs")


def replay(bench: Bench, statement: Statement) -> None:
    """Runs a captured statement again with its parameters, in a transaction rolled back."""
    with bench.db_engine.connect() as conn:
        conn.exec_driver_sql(statement.sql, statement.params).all()
        conn.rollback()


# --- the worker's steps and rounds ---------------------------------------------------------------------


def _step_rows(bench: Bench) -> list[str]:
    return make_running(bench, bench.spare_ids(0, CLAIM), first_token=False)


def _finishing_rows(bench: Bench) -> list[str]:
    return make_running(bench, bench.spare_ids(0, CLAIM), first_token=True)


def _first_tokens(bench: Bench, job_ids: list[str]) -> list[str]:
    now = utcnow()
    with bench.sessions() as session:
        return jobs.record_step(session, [jobs.FirstToken(job_id, 1, now) for job_id in job_ids], [], now)


def _outcomes(bench: Bench, job_ids: list[str]) -> list[str]:
    now = utcnow()
    outcomes: list[jobs.Outcome] = [jobs.Completion(job_id, 1, ANSWER, "stop", 40, 64, 0, None)
                                    for job_id in job_ids]
    with bench.sessions() as session:
        return jobs.record_step(session, [], outcomes, now)


def _attempt_states(bench: Bench, _prepared: Any) -> object:
    with bench.sessions() as session:
        return jobs.attempt_states(session, bench.running)


def _heartbeat(bench: Bench, _prepared: Any) -> object:
    with bench.sessions() as session:
        return workers.heartbeat(session, WORKER_ID, utcnow(), PACE)


class QuietBroker:
    """The reconciler's broker: takes what is published, never reports a queue empty or its messages lost
    (so a round republishes nothing: the data stays as it is)."""

    def publish(self, job_id: str, queue: str) -> None:
        pass

    def depth(self, queue: str) -> int:
        return 1

    def lost_messages(self) -> bool:
        return False


def _begin_walk(bench: Bench) -> None:
    """The broker lost its queues: a walk of the bench's lane begins (core/store/republish_walk.py)."""
    with bench.sessions() as session:
        republish_walk.begin(session, utcnow(), [bench.queue])


def _republish_batch(bench: Bench, _prepared: Any) -> object:
    """One batch of a broker restart's republish, as a reconciler walks it (worker/reconciler.py): the walk's
    row locked, REDISPATCH_BATCH queued jobs read after its cursor, published (here: to nowhere), the cursor
    moved past them. No job row is written."""
    with bench.sessions() as session:
        walk = republish_walk.take(session)
        assert walk is not None, "_begin_walk began one"
        batch = republish_walk.next_batch(session, walk, REDISPATCH_BATCH)  # fewer at the smallest scales
        return republish_walk.advance(session, walk, batch, False, [bench.queue])


def _end_walk(bench: Bench, _prepared: Any, _result: Any) -> None:
    """No walk left under way: the reconciler rounds timed later must find none."""
    with bench.sessions() as session:
        session.execute(delete(BrokerRepublish))
        session.commit()


def _reconciler(bench: Bench) -> Reconciler:
    """A fresh reconciler, the bench worker's heartbeat renewed first (its running jobs are not orphans)."""
    _heartbeat(bench, None)
    return Reconciler(bench.sessions, QuietBroker(), bench.settings)


def _reconcile(_bench: Bench, reconciler: Reconciler) -> object:
    report = reconciler.run_once()
    changed = report.expired + report.requeued + report.published + report.redispatched + report.lost
    if changed:
        raise RuntimeError(f"the reconciler round changed the bench's data: {report}")
    return report


def _purge(_bench: Bench, reconciler: Reconciler) -> object:
    report = reconciler.purge_once()
    if report.total:
        raise RuntimeError(f"the purge deleted the bench's data (retention too short): {report}")
    return report


# --- submit ------------------------------------------------------------------------------------------------


def new_job(bench: Bench) -> jobs.NewJob:
    request = {"prompt": "Summarize the attached report.", "queue": bench.queue, "max_tokens": 128}
    return jobs.NewJob(tenant_id=bench.tenant, queue=bench.queue, prompt=str(request["prompt"]),
                       messages=None, params=JobParams(max_tokens=128).stored(), meta=None, webhook=None,
                       idempotency_key=None, request_hash=jobs.request_hash(request), prompt_tokens=8,
                       ttl_s=600.0, timeout_s=None)


def _add(bench: Bench, _prepared: Any) -> str:
    with bench.sessions() as session:
        return jobs.add(session, new_job(bench), utcnow()).id


def _count_queued(bench: Bench, _prepared: Any) -> object:
    """As admission counts (api/admission.py): from the job tallies, whatever the queue's max_queued."""
    with bench.sessions() as session:
        return jobs.count_queued(session, bench.queue)


def _count_queued_tenant(bench: Bench, _prepared: Any) -> object:
    """A tenant quota's count, from the tallies too."""
    with bench.sessions() as session:
        return jobs.count_queued(session, bench.queue, bench.tenant)


def _count_scheduled_in(bench: Bench, _prepared: Any) -> object:
    """A submit with run_at: the tenant's scheduled jobs in the lane (api/admission.py scheduled_refusal)."""
    with bench.sessions() as session:
        return jobs.count_scheduled_in(session, bench.queue, bench.tenant)


def _effective_limits(bench: Bench, _prepared: Any) -> object:
    with bench.sessions() as session:
        return tenants.effective_limits(session, bench.tenant, bench.defaults)


def _tokens_used(bench: Bench, _prepared: Any) -> object:
    with bench.sessions() as session:
        return token_usage.tokens_used(session, bench.tenant, utcnow())


def _forecast(bench: Bench, _prepared: Any) -> object:
    with bench.sessions() as session:
        return finish_times.forecast(session, bench.queue, utcnow(), deadline_s=300.0, prompt_tokens=200,
                                     max_tokens=128, choices=1,
                                     dead_after_s=bench.settings.worker_dead_after_s)


def _by_idempotency_key(bench: Bench, _prepared: Any) -> object:
    with bench.sessions() as session:
        return jobs.by_idempotency_key(session, *bench.idempotent)


def _dispatch(bench: Bench, _prepared: Any) -> object:
    pending = [(job_id, bench.queue) for job_id in bench.spare_ids(CLAIM, 2 * CLAIM)]
    return publish_and_mark(bench.sessions, lambda _job_id, _queue: None, pending)


# --- the API's reads and a cancel ------------------------------------------------------------------------


def _get(bench: Bench, _prepared: Any) -> object:
    job_id, tenant = bench.spare[2 * CLAIM]
    with bench.sessions() as session:
        return jobs.get(session, job_id, tenant)


def _page(bench: Bench, _prepared: Any) -> object:
    with bench.sessions() as session:
        return jobs.page(session, bench.tenant, limit=21)  # the route's default limit + 1


def _cancel(bench: Bench, _prepared: Any) -> list[str]:
    job_id, tenant = bench.spare[2 * CLAIM + 1]
    with bench.sessions() as session:
        jobs.cancel(session, job_id, tenant, utcnow())
    return [job_id]


def _scheduler_round(bench: Bench, _prepared: Any) -> object:
    """A scheduler's round with nothing due: the due sweep and the next due time (worker/promoter.py)."""
    with bench.sessions() as session:
        promoted = jobs.promote_due(session, utcnow())
        if promoted:
            raise RuntimeError(f"the scheduler round changed the bench's data: {len(promoted)} job(s) due")
        return jobs.next_due(session)


def _queue_counts(bench: Bench, _prepared: Any) -> object:
    with bench.sessions() as session:
        return job_tallies.queue_counts(session, utcnow())


def _queue_counts_tenant(bench: Bench, _prepared: Any) -> object:
    with bench.sessions() as session:
        return job_tallies.queue_counts(session, utcnow(), bench.tenant)


def _deadline_counts(bench: Bench, _prepared: Any) -> object:
    since: datetime = utcnow() - GOODPUT_WINDOW
    with bench.sessions() as session:
        return jobs.deadline_counts(session, since)


def _queue_loads(bench: Bench, _prepared: Any) -> object:
    with bench.sessions() as session:
        return job_tallies.tallies(session)


def _per_tenant(bench: Bench, _prepared: Any) -> object:
    with bench.sessions() as session:
        return job_tallies.per_tenant(session)


def _outcome_counts(bench: Bench, _prepared: Any) -> object:
    with bench.sessions() as session:
        return outcome_counts.all_counts(session)


def _scrape(bench: Bench, _prepared: Any) -> object:
    return list(StoreCollector(bench.settings, bench.sessions).collect())


WORKER_CLAIM, WORKER_STEP, WORKER_ROUND = "worker claim", "worker step", "worker round"
SUBMIT, API_READ = "submit", "API"
OPERATIONS = (
    Operation(f"fair claim of {CLAIM} (fresh backlog view)", WORKER_CLAIM, fair_claim, undo=_undo_requeue),
    Operation("fair claim: its backlog read (replayed)", WORKER_CLAIM, replay, prepare=_backlog_read),
    Operation("fair claim: one stream's read (… SKIP LOCKED)", WORKER_CLAIM, replay, prepare=_tenant_select),
    Operation(f"record_step: first tokens of {CLAIM}", WORKER_STEP, _first_tokens, prepare=_step_rows,
              undo=_undo_prepared),
    Operation(f"record_step: outcomes of {CLAIM}", WORKER_STEP, _outcomes, prepare=_finishing_rows,
              undo=_undo_prepared),
    Operation(f"attempt_states of {CLAIM} (cancel watch)", WORKER_STEP, _attempt_states),
    Operation("heartbeat", WORKER_STEP, _heartbeat),
    Operation("reconciler round (run_once)", WORKER_ROUND, _reconcile, prepare=_reconciler),
    Operation("retention purge (nothing due)", WORKER_ROUND, _purge, prepare=_reconciler),
    Operation("scheduler round (nothing due)", WORKER_ROUND, _scheduler_round),
    Operation(f"republish after a broker restart: a batch of {REDISPATCH_BATCH}", WORKER_ROUND,
              _republish_batch, prepare=_begin_walk, undo=_end_walk),
    Operation("count_queued(queue) (admission, tallies)", SUBMIT, _count_queued),
    Operation("count_queued(queue, tenant) (quota, tallies)", SUBMIT, _count_queued_tenant),
    Operation("count_scheduled_in(lane, tenant) (run_at quota)", SUBMIT, _count_scheduled_in),
    Operation("effective_limits (tenant row)", SUBMIT, _effective_limits),
    Operation("tokens_used (tokens per minute)", SUBMIT, _tokens_used),
    Operation("finish_times.forecast (deadline submit)", SUBMIT, _forecast),
    Operation("by_idempotency_key", SUBMIT, _by_idempotency_key),
    Operation("submit (jobs.add)", SUBMIT, _add, undo=lambda b, _p, job_id: _delete(b, job_id)),
    Operation(f"dispatch relay: publish_and_mark of {CLAIM}", SUBMIT, _dispatch),
    Operation("get job (status, long poll)", API_READ, _get),
    Operation("list a tenant's jobs (first page)", API_READ, _page),
    Operation("cancel a queued job", API_READ, _cancel, undo=_undo_requeue),
    Operation("/v1/queues counts (queue_counts, all)", API_READ, _queue_counts),
    Operation("/v1/queues counts (queue_counts, one tenant)", API_READ, _queue_counts_tenant),
    Operation("/v1/queues goodput (deadline_counts, 1 h)", API_READ, _deadline_counts),
    Operation("/v1/scaling (tallies)", API_READ, _queue_loads),
    Operation("console tenants' counts (per_tenant)", API_READ, _per_tenant),
    Operation("/metrics finished counts (all_counts)", API_READ, _outcome_counts),
    Operation("/metrics scrape (StoreCollector.collect)", API_READ, _scrape),
)
