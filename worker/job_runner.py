"""The bridge between the job store and one EngineHost, shared by the Celery worker and the embedded runtime.

A job id comes in (from a broker message or an in-process queue); the runner claims the row (a conditional
UPDATE, so a duplicate or late message is dropped), hands the prompt to the engine, and writes the outcome.
Work goes in groups, because per-job transactions, not the engine, are what limit short jobs: the jobs
handed over together are claimed in one statement, and everything one engine step produced (first tokens,
outcomes) is written by one "writer" thread in one transaction (jobs.record_step), each row still behind
its own conditional UPDATE. When the writer falls behind, the next group simply holds several steps. A
group is kept and retried until the store takes it (a database outage only delays it); its jobs hold their
places in their queues' limits meanwhile, which bounds what waits. A watcher thread polls the store for
cancels, enforces `timeout`, and aborts attempts the store no longer calls current (the job was requeued
to another worker while this one was paused or cut off).

Attempts, not jobs, are the unit here: the table of running work is keyed by request id (`job#attempt`),
so a late attempt 1 can never remove, or answer for, an attempt 2 of the same job in this worker. An attempt
whose engine step ran out of device memory is submitted once more, within the same attempt, before its
failure is written (worker/transient.py says which errors qualify).

The per-queue hold lives here: `has_room(queue)` / `wait_for_room(queue, ...)` say whether fewer than the
queue's `max_running` jobs of it are in flight in this worker; the Celery consumer and the embedded feeders
take a job only when there is room.
"""

from __future__ import annotations

import logging
import queue as stdlib_queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker
from tenacity import Retrying, retry_if_exception_type, wait_exponential

from core.clock import utcnow
from core.dispatch import Publish, publish_and_mark
from core.finished_jobs import FinishedSink
from core.lifecycle import CANCELLED, RUNNING
from core.store import fair_share, jobs, tenants
from core.store.fair_share import FairState
from core.store.tables import Job
from core.store.tenants import TenantLimits
from core.token_stream import TokenSink
from engine.host import EngineHost
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from worker.logprobs import job_logprobs
from worker.sampling import sampling_params_from_json
from worker.streamer import JobStreamer
from worker.transient import is_transient

log = logging.getLogger(__name__)

OnDone = Callable[[], None]  # called once per started job, after its outcome is stored (the caller acks)

INVALID_REQUEST, ENGINE_ERROR, TIMEOUT = "invalid_request", "engine_error", "timeout"
CANCELLED_REASON, SHUTDOWN, SUPERSEDED = "cancelled", "shutdown", "superseded"  # aborts with nothing to write
STORE_RETRY_FIRST_WAIT_S = 0.2  # first pause between outcome writes while the database is unreachable,
STORE_RETRY_MAX_WAIT_S = 5.0  # doubling up to this
ABORT_WAIT_S = 10.0  # how long an abort may take to come back from the engine at shutdown
GROUP_LINGER_S = 0.005  # how long the writer waits for the rest of a step before writing what it has
MAX_GROUP = 512  # writes per transaction


@dataclass
class RunningJob:
    job_id: str
    attempt: int
    queue: str
    request_id: str
    timeout_s: float | None
    started: float  # time.monotonic() at claim
    on_done: OnDone
    logprobs: int | None = None  # top-n alternatives asked for per generated token
    abort_reason: str | None = None  # "cancelled" | "timeout" | "shutdown" | "superseded" once aborted
    first_token_seen: bool = False
    engine_input: tuple[str | list[int], SamplingParams] | None = None  # what was submitted, for a retry
    retried: bool = False  # a transient engine error (out of memory) already had its one retry
    cache_salt: str | None = None  # its tenant's prefix-cache partition (core/store/tenants.py cache_salt)
    # Waiting for its grammar to compile, outside the engine: not counted in its queue's room here
    # (_room), so a costly schema holds up no other job's start.
    compiling: bool = False


@dataclass(frozen=True)
class _FirstToken:
    handle: RunningJob
    at: datetime


@dataclass(frozen=True)
class _Ended:
    """An attempt left the engine (or never entered it): its outcome to write, then its handle to release."""

    handle: RunningJob
    future: Future[RequestOutput] | None = None  # resolved; None: `failure` says what happened
    failure: tuple[str, str] | None = None  # (code, message) of an attempt the engine refused


_STEP_END = "step end"  # in the writer's inbox: the engine step's outputs are all in
_STOP = "stop"
_WriterItem = _FirstToken | _Ended | str


class RunnerStoppedError(RuntimeError):
    """The runner is shutting down: the caller must put the message back, not drop it."""


class JobRunner:
    def __init__(
        self, host: EngineHost, sessions: sessionmaker[Session], worker_id: str, *,
        limits: dict[str, int] | None = None, cancel_poll_s: float = 0.5, tokens: TokenSink | None = None,
        finished: FinishedSink | None = None, tenant_defaults: TenantLimits | None = None,
    ) -> None:
        self.host = host
        self.worker_id = worker_id
        self.limits = dict(limits or {})  # queue -> max_running in this worker; a queue not named: no hold
        self._sessions = sessions
        self._cancel_poll_s = cancel_poll_s
        self._streamer = JobStreamer(tokens) if tokens is not None else None  # text deltas to the API
        self._finished = finished  # told which jobs each group made final (long polls wake)
        self._tenant_defaults = tenant_defaults or TenantLimits()  # weights and max_running, fair claims
        self._fair = {name: FairState() for name in self.limits}  # per queue: whom it served, what waits
        self._lock = threading.Lock()
        self._running: dict[str, RunningJob] = {}  # by request id (job#attempt)
        self._job_left = threading.Condition(self._lock)
        self._inbox: stdlib_queue.SimpleQueue[_WriterItem] = stdlib_queue.SimpleQueue()  # to the writer
        self._step_had_news = False  # the current engine step queued something for the writer
        self._writer = threading.Thread(target=self._write_loop, name="job-writer", daemon=True)
        self._stop = threading.Event()
        self._abandon_writes = threading.Event()  # shutdown's last resort: unwritten outcomes are dropped
        self._shut_down = False
        self._watcher = threading.Thread(target=self._watch, name="job-watcher", daemon=True)

    def start(self) -> None:
        self.host.on_step_end(self._step_ended)
        self._writer.start()
        self._watcher.start()

    # --- taking a job --------------------------------------------------------------------------------

    def run(self, job_id: str, on_done: OnDone) -> bool:
        """`run_many` of one job."""
        return self.run_many([(job_id, on_done)])[0]

    def run_many(self, requests: list[tuple[str, OnDone]]) -> list[bool]:
        """Claims the jobs in one statement and submits those it got; per request, whether it started.
        A job not started (done, cancelled, expired or already running: not ours to run) never calls its
        on_done.

        Raises RunnerStoppedError once shutdown has begun, and store errors as they come.
        """
        if self._stop.is_set():
            raise RunnerStoppedError("the runner is shutting down")
        with self._sessions() as session:
            claimed = jobs.claim_many(session, [job_id for job_id, _ in requests], self.worker_id, utcnow())
            salts = tenants.cache_salts(session, [job.tenant_id for job in claimed])
        unstarted = {job.id: job for job in claimed}
        to_start, started = [], []
        for job_id, on_done in requests:
            job = unstarted.pop(job_id, None)  # a job listed twice starts once
            if job is None:
                log.info("job %s not claimable (done, cancelled, expired or running); dropped", job_id)
            else:
                to_start.append((job, on_done))
            started.append(job is not None)
        self._start_all(to_start, salts)
        return started

    def run_next(self, queue: str, on_dones: list[OnDone]) -> int:
        """Claims up to len(on_dones) jobs of `queue` in fair order (core/store/fair_share.py: whichever
        jobs are next, not named ones) and starts them, the i-th with on_dones[i]. Returns how many started:
        on_dones beyond that are never called.

        Raises RunnerStoppedError once shutdown has begun, and store errors as they come.
        """
        if self._stop.is_set():
            raise RunnerStoppedError("the runner is shutting down")
        state = self._fair.setdefault(queue, FairState())
        with self._sessions() as session:
            claimed = fair_share.claim_fair(session, queue, len(on_dones), self.worker_id, utcnow,
                                            self._tenant_defaults, state)
            salts = tenants.cache_salts(session, [job.tenant_id for job in claimed])
        self._start_all(list(zip(claimed, on_dones, strict=False)), salts)
        return len(claimed)

    def _start_all(self, claimed: list[tuple[Job, OnDone]], salts: dict[str, str]) -> None:
        """Holds every claimed attempt first, then submits them one by one (a submit compiles nothing: a new
        schema compiles on the engine host's compile thread), since the reconciler requeues a claim its
        worker does not hold once it is older than dispatch_grace_s. `salts`: each tenant's prefix-cache
        salt, read with the claim."""
        handles = [self._hold(job, on_done, salts[job.tenant_id]) for job, on_done in claimed]
        for (job, _), handle in zip(claimed, handles, strict=True):
            self._submit(job, handle)

    def _hold(self, job: Job, on_done: OnDone, cache_salt: str) -> RunningJob:
        handle = RunningJob(job.id, job.attempts, job.queue, f"{job.id}#{job.attempts}", job.timeout_s,
                            time.monotonic(), on_done, logprobs=(job.params or {}).get("logprobs"),
                            cache_salt=cache_salt, compiling="structured" in (job.params or {}))
        with self._lock:
            self._running[handle.request_id] = handle
        return handle

    def _submit(self, job: Job, handle: RunningJob) -> None:
        try:
            prompt, params = self._engine_input(job)
            handle.engine_input = (prompt, params)
            future = self.host.submit(handle.request_id, prompt, params, job.queue,
                                      on_update=lambda out: self._on_update(handle, out),
                                      cache_salt=handle.cache_salt,
                                      on_admitted=lambda: self._admitted(handle))
        except ValueError as exc:
            self._inbox.put(_Ended(handle, failure=(INVALID_REQUEST, str(exc))))
            return
        except Exception as exc:
            log.exception("engine refused job %s", job.id)
            self._inbox.put(_Ended(handle, failure=(ENGINE_ERROR, _describe(exc))))
            return
        future.add_done_callback(lambda f: self._ended(handle, f))

    def _admitted(self, handle: RunningJob) -> None:
        """The engine has the attempt (its grammar compiled): it counts in its queue's room from now on."""
        with self._lock:
            handle.compiling = False
            self._job_left.notify_all()

    def _ended(self, handle: RunningJob, future: Future[RequestOutput]) -> None:
        if not self._retried_once(handle, future):
            self._to_writer(_Ended(handle, future))

    def _retried_once(self, handle: RunningJob, future: Future[RequestOutput]) -> bool:
        """Submits the attempt again, once, after a transient engine error (worker/transient.py), under a new
        request id (the failed one's abort output is still being delivered in this step); the store sees
        one attempt. False when it is not retried: the failure is then written as usual."""
        error = future.exception()
        if (error is None or handle.retried or handle.engine_input is None or handle.abort_reason is not None
                or self._stop.is_set() or not is_transient(error)):
            return False
        handle.retried = True
        log.warning("job %s attempt %d: %s; retrying it once on this worker", handle.job_id, handle.attempt,
                    _describe(error))
        retry_id = f"{handle.request_id}~retry"
        with self._lock:
            self._running.pop(handle.request_id, None)
            handle.request_id = retry_id
            self._running[retry_id] = handle
        try:
            retry = self.host.submit(retry_id, *handle.engine_input, handle.queue,
                                     on_update=lambda out: self._on_update(handle, out),
                                     cache_salt=handle.cache_salt, on_admitted=lambda: self._admitted(handle))
        except Exception:
            log.exception("job %s: the retry was refused", handle.job_id)
            return False
        retry.add_done_callback(lambda f: self._ended(handle, f))
        return True

    def _engine_input(self, job: Job) -> tuple[str | list[int], SamplingParams]:
        params = sampling_params_from_json(job.params or {})
        if job.messages is not None:
            return self.host.tokenizer.apply_chat_template(job.messages), params
        if job.prompt is None:
            raise ValueError("prompt: the job has neither a prompt nor messages")
        return job.prompt, params

    # --- engine thread -------------------------------------------------------------------------------

    def _on_update(self, handle: RunningJob, out: RequestOutput) -> None:
        if self._streamer is not None:
            self._streamer.update(handle.job_id, handle.attempt, out)
        if handle.first_token_seen or out.metrics.first_token_time is None:
            return
        handle.first_token_seen = True
        self._to_writer(_FirstToken(handle, _to_datetime(out.metrics.first_token_time)))

    def _to_writer(self, item: _FirstToken | _Ended) -> None:
        self._step_had_news = True
        self._inbox.put(item)

    def _step_ended(self) -> None:
        if self._step_had_news:
            self._step_had_news = False
            self._inbox.put(_STEP_END)

    # --- writer thread -------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        stopping = False
        while not stopping:
            group, stopping = self._next_group(self._inbox.get())
            if group:
                self._write_group(group)

    def _next_group(self, first: _WriterItem) -> tuple[list[_FirstToken | _Ended], bool]:
        """`first` and what follows it of the same engine step (and any later ones already waiting).
        Returns (group, whether the stop marker was seen)."""
        group: list[_FirstToken | _Ended] = []
        step_over, item = False, first
        while True:
            if item is _STOP:
                return group, True
            if item is _STEP_END:
                step_over = True
            else:
                assert isinstance(item, _FirstToken | _Ended)
                group.append(item)
            if len(group) >= MAX_GROUP:
                return group, False
            try:  # once the step is over, only what is already here; before, a moment for the rest of it
                item = self._inbox.get(block=not step_over, timeout=None if step_over else GROUP_LINGER_S)
            except stdlib_queue.Empty:
                return group, False

    def _write_group(self, group: list[_FirstToken | _Ended]) -> None:
        ended = [item for item in group if isinstance(item, _Ended)]
        ending = {item.handle.request_id for item in ended}
        first_tokens = [jobs.FirstToken(item.handle.job_id, item.handle.attempt, item.at) for item in group
                        if isinstance(item, _FirstToken) and item.handle.request_id not in ending]
        outcomes = [outcome for item in ended if (outcome := self._outcome(item)) is not None]
        try:
            finished = self._write(jobs.record_step, first_tokens, outcomes, utcnow())
        except OperationalError as exc:  # only at a shutdown that cannot wait for the store any longer
            log.error("shutdown: %d outcome(s) not stored (%s); the jobs stay running under this worker, "
                      "and another worker's reconciler requeues them", len(outcomes), _describe(exc))
            finished = []
        except Exception:  # not the database being away: one of the writes itself
            log.exception("a group of %d write(s) failed; writing them one by one", len(outcomes))
            finished = self._write_each(outcomes)
        if finished and self._finished is not None:
            self._finished.finished(finished)
        for item in ended:
            self._release(item.handle)

    def _write_each(self, outcomes: list[jobs.Outcome]) -> list[str]:
        """The outcomes of a group that failed, each in its own transaction: a result the store cannot take
        becomes a failure of that job alone."""
        finished = []
        for outcome in outcomes:
            try:
                finished += self._write(jobs.record_step, [], [outcome], utcnow())
            except Exception as exc:
                log.exception("job %s: could not store its outcome", outcome.job_id)
                if isinstance(outcome, jobs.Completion):
                    failure = jobs.Failure(outcome.job_id, outcome.attempt, ENGINE_ERROR,
                                           f"could not store the result: {type(exc).__name__}")
                    finished += self._write_failure(failure)
        return finished

    def _write_failure(self, failure: jobs.Failure) -> list[str]:
        try:
            return self._write(jobs.record_step, [], [failure], utcnow())
        except Exception:
            log.exception("job %s: could not store its failure (%s)", failure.job_id, failure.code)
            return []

    def _outcome(self, item: _Ended) -> jobs.Outcome | None:
        """What to write for an attempt that ended; None when there is nothing to write."""
        handle = item.handle
        if item.future is None:
            assert item.failure is not None
            return self._failure(handle, *item.failure)
        try:
            out = item.future.result()
        except ValueError as exc:  # the engine refused it after submit: a grammar that cannot be compiled
            return self._failure(handle, INVALID_REQUEST, str(exc))
        except Exception as exc:
            return self._failure(handle, ENGINE_ERROR, _describe(exc))
        if out.finish_reason == "abort":
            return self._abort_outcome(handle, out)
        try:
            logprobs = job_logprobs(out.token_ids, out.logprobs, handle.logprobs, self.host.tokenizer)
        except Exception as exc:
            log.exception("job %s: could not build its logprobs", handle.job_id)
            return self._failure(handle, ENGINE_ERROR, f"could not store the result: {type(exc).__name__}")
        return jobs.Completion(
            handle.job_id, handle.attempt, result_text=_storable(out.text),
            finish_reason=str(out.finish_reason), prompt_tokens=len(out.prompt_token_ids),
            completion_tokens=len(out.token_ids), preemptions=out.metrics.num_preemptions,
            first_token_at=_to_datetime(out.metrics.first_token_time), logprobs=logprobs,
            cached_tokens=out.num_cached_tokens,
        )

    def _abort_outcome(self, handle: RunningJob, out: RequestOutput) -> jobs.Outcome | None:
        preemptions = out.metrics.num_preemptions
        if handle.abort_reason == TIMEOUT:
            message = f"timeout: ran longer than {handle.timeout_s} s"
            return self._failure(handle, TIMEOUT, message, preemptions)
        if handle.abort_reason is None:  # aborted by the engine itself
            return self._failure(handle, ENGINE_ERROR, "aborted by the engine", preemptions)
        return None  # cancelled (already so in the store), handed back at shutdown, or superseded

    def _failure(self, handle: RunningJob, code: str, message: str, preemptions: int = 0) -> jobs.Failure:
        log.warning("job %s attempt %d failed: %s: %s", handle.job_id, handle.attempt, code, message)
        return jobs.Failure(handle.job_id, handle.attempt, code, _storable(message), preemptions)

    def _write(self, transition: Callable[..., list[str]], *args: Any) -> list[str]:
        """One store write in its own session, retried for as long as the database is unreachable (its
        transitions are conditional UPDATEs, so a retry after a commit whose answer was lost is a no-op).
        Only a shutdown that cannot wait any longer gives up (OperationalError); the jobs then stay
        `running` under this worker, whose heartbeat stops, and another worker's reconciler requeues them."""
        backoff = wait_exponential(multiplier=STORE_RETRY_FIRST_WAIT_S, max=STORE_RETRY_MAX_WAIT_S)
        retrying = Retrying(retry=retry_if_exception_type(OperationalError),
                            stop=lambda _: self._abandon_writes.is_set(), wait=backoff,
                            before_sleep=_log_store_retry, reraise=True)
        for attempt in retrying:
            with attempt, self._sessions() as session:
                return transition(session, *args)
        raise AssertionError("unreachable: Retrying either returns or raises")

    def _release(self, handle: RunningJob) -> None:
        with self._lock:
            self._running.pop(handle.request_id, None)
            self._job_left.notify_all()
        if self._streamer is not None:
            self._streamer.end(handle.job_id, handle.attempt)
        try:
            handle.on_done()
        except Exception:
            log.exception("on_done failed for job %s", handle.job_id)

    # --- watcher thread ------------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(self._cancel_poll_s):
            try:
                self.check_once()
            except Exception:  # the database may be briefly unreachable; try again next tick
                log.exception("cancel/timeout check failed")

    def check_once(self) -> None:
        """Aborts attempts that were cancelled in the store, were superseded (the job was requeued or taken
        by another attempt), or have run past their timeout."""
        with self._lock:
            live = [h for h in self._running.values() if h.abort_reason is None]
        if not live:
            return
        with self._sessions() as session:
            states = jobs.attempt_states(session, list({h.job_id for h in live}))
        now = time.monotonic()
        for handle in live:
            state = states.get(handle.job_id)
            if state is not None and state.status == CANCELLED:
                self._abort(handle, CANCELLED_REASON)
            elif not self._is_current(handle, state):
                self._abort(handle, SUPERSEDED)
            elif handle.timeout_s is not None and now - handle.started > handle.timeout_s:
                self._abort(handle, TIMEOUT)

    def _is_current(self, handle: RunningJob, state: jobs.AttemptState | None) -> bool:
        """Whether the store still runs this attempt here. A finished attempt whose outcome is on its way
        is still current: its row says so until the outcome write lands."""
        return (state is not None and state.status == RUNNING and state.attempts == handle.attempt
                and state.worker_id == self.worker_id)

    def _abort(self, handle: RunningJob, reason: str) -> None:
        handle.abort_reason = reason
        if self.host.cancel(handle.request_id):
            log.info("job %s: aborting in the engine (%s)", handle.job_id, reason)

    # --- shutdown ------------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        with self._lock:
            return len(self._running)

    def held_attempts(self) -> set[tuple[str, int]]:
        """(job id, attempt) of every attempt in flight here, its outcome written or not."""
        with self._lock:
            return {(h.job_id, h.attempt) for h in self._running.values()}

    def has_room(self, queue: str) -> bool:
        """Whether a job of `queue` may start now: fewer than its max_running are in flight here."""
        with self._lock:
            return self._has_room(queue)

    def wait_for_room(self, queue: str, timeout_s: float) -> bool:
        """Blocks until has_room(queue) or timeout_s passes; says which."""
        with self._lock:
            return self._job_left.wait_for(lambda: self._has_room(queue), timeout_s)

    def room(self, queue: str) -> int:
        """How many more jobs of `queue` may start now (sys.maxsize for a queue without a limit here)."""
        with self._lock:
            return self._room(queue)

    def _has_room(self, queue: str) -> bool:
        return self._room(queue) > 0

    def _room(self, queue: str) -> int:
        """NOTE: attempts waiting for their grammar do not count against the limit: a tenant's costly schemas
        hold up no one's start (any cap on them, once reached, would). What bounds them is the claim: fair
        share hands a tenant its share of the claims, its max_running caps its running jobs fleet-wide, and
        the compile thread takes tenants in turn (engine/grammar_queue.py)."""
        limit = self.limits.get(queue)
        if limit is None:
            return sys.maxsize
        in_engine = sum(1 for h in self._running.values() if h.queue == queue and not h.compiling)
        return max(0, limit - in_engine)

    def wait_idle(self, timeout_s: float, tick: Callable[[], None] | None = None) -> bool:
        """Waits until no job is in flight, calling `tick` (e.g. flush acks) every 0.1 s in this thread."""
        deadline = time.monotonic() + timeout_s
        while True:
            if tick is not None:
                tick()
            with self._lock:
                remaining = deadline - time.monotonic()
                if not self._running or remaining <= 0:
                    return not self._running
                self._job_left.wait(min(0.1, remaining))

    def shutdown(
        self, grace_s: float, publish: Publish | None, tick: Callable[[], None] | None = None
    ) -> list[str]:
        """Stops taking jobs, lets in-flight ones finish within grace_s, then aborts the rest and puts them
        back in the queue (running -> queued in the store, then re-published). Returns the requeued ids.
        Idempotent: a second call does nothing."""
        self._stop.set()
        with self._lock:
            if self._shut_down:
                return []
            self._shut_down = True
        requeued: list[tuple[str, str]] = []
        if not self.wait_idle(grace_s, tick):
            with self._lock:
                left = list(self._running.values())
            for handle in left:
                self._abort(handle, SHUTDOWN)
            if not self.wait_idle(ABORT_WAIT_S, tick):
                self._abandon_writes.set()  # the store is down: unwritten outcomes are left to the fleet
            requeued = self._requeue_own_jobs()
        self._abandon_writes.set()
        self.host.remove_step_listener(self._step_ended)
        self._inbox.put(_STOP)
        if self._writer.is_alive():
            self._writer.join()
        if tick is not None:
            tick()
        if self._watcher.is_alive():
            self._watcher.join()
        if publish is not None and requeued:
            publish_and_mark(self._sessions, publish, requeued)
        return [job_id for job_id, _ in requeued]


    def _requeue_own_jobs(self) -> list[tuple[str, str]]:
        try:
            with self._sessions() as session:
                requeued = jobs.requeue_orphans(session, [self.worker_id], utcnow())
        except OperationalError as exc:
            log.error("shutdown: could not requeue unfinished jobs (%s); another worker's reconciler will, "
                      "once this worker's heartbeat is overdue", _describe(exc))
            return []
        log.warning("shutdown: requeued %d unfinished job(s)", len(requeued))
        return requeued


def _log_store_retry(state: Any) -> None:
    exc = state.outcome.exception() if state.outcome is not None else None
    log.warning("store unreachable (%s); outcome write retry %d", _describe(exc) if exc else "?",
                state.attempt_number)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _storable(text: str) -> str:
    """Postgres text cannot hold NUL characters, which a random-weight model happily writes."""
    return text.replace("\x00", "\ufffd")


def _to_datetime(ts: float | None) -> datetime | None:
    return datetime.fromtimestamp(ts, tz=timezone.utc) if ts is not None else None
