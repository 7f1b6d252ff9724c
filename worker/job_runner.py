"""The bridge between the job store and one EngineHost, shared by the Celery worker and the embedded runtime.

A job id comes in (from a broker message or an in-process queue); the runner claims the row (a conditional
UPDATE, so a duplicate or late message is dropped), makes it an attempt (worker/attempt.py) in flight here
and hands it to the attempt submitter (worker/attempt_submitter.py), which submits its requests to the engine
and routes what comes back. The jobs handed over together are claimed in one statement. The rest is done by
parts of their own:
- the outcome writer (worker/outcome_writer.py) stores what each engine step produced in one transaction,
  then releases the attempts it ended (the runner's `_release`: out of flight, the caller acks);
- the attempt watcher (worker/attempt_watcher.py) aborts cancelled, timed-out and superseded attempts;
- each queue's room (worker/queue_room.py): `has_room(queue)` / `wait_for_room(queue, ...)` say whether
  fewer than the queue's `max_running` jobs of it are in flight in this worker; the Celery consumer and the
  embedded feeders take a job only when there is room.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime

from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.clock import utcnow
from conveyor.core.retry_policy import Backoff
from conveyor.core.seams.dispatch import Publish, publish_and_mark
from conveyor.core.seams.finish_notifications import FinishedSink
from conveyor.core.seams.token_stream import TokenSink
from conveyor.core.store import fair_share, jobs, tenants
from conveyor.core.store.fair_share import FairState
from conveyor.core.store.held_sessions import HeldSessions
from conveyor.core.store.jobs.claims import ClaimedJob
from conveyor.core.store.tables import Job
from conveyor.core.store.tenants import TenantLimits
from conveyor.engine.host import EngineHost
from conveyor.worker.adapters import RuntimeAdapters
from conveyor.worker.attempt import SHUTDOWN, Attempt, OnDone
from conveyor.worker.attempt_outcome import describe
from conveyor.worker.attempt_submitter import AttemptSubmitter
from conveyor.worker.attempt_watcher import AttemptWatcher
from conveyor.worker.in_flight import InFlight
from conveyor.worker.outcome_writer import OutcomeWriter
from conveyor.worker.queue_room import QueueRoom
from conveyor.worker.streamer import JobStreamer

log = logging.getLogger(__name__)

ABORT_WAIT_S = 10.0  # how long an abort may take to come back from the engine at shutdown


class RunnerStoppedError(RuntimeError):
    """The runner is shutting down: the caller must put the message back, not drop it."""


class JobRunner:
    def __init__(
        self, host: EngineHost, sessions: sessionmaker[Session], worker_id: str, *,
        limits: dict[str, int] | None = None, cancel_poll_s: float = 0.5, tokens: TokenSink | None = None,
        finished: FinishedSink | None = None, tenant_defaults: TenantLimits | None = None,
        adapters: RuntimeAdapters | None = None, backoff: Backoff | None = None,
    ) -> None:
        self.host = host
        self.worker_id = worker_id
        self._sessions = sessions
        # Claims (by the consumer or a feeder) and outcome groups (by the writer) come one after another:
        # each thread keeps its connection between them (core/store/held_sessions.py).
        self._held = HeldSessions(sessions)
        self._streamer = JobStreamer(tokens) if tokens is not None else None  # text deltas to the API
        self._tenant_defaults = tenant_defaults or TenantLimits()  # weights and max_running, fair claims
        self._in_flight = InFlight()
        self.queue_room = QueueRoom(limits or {}, self._in_flight)
        self._fair = {name: FairState() for name in self.limits}  # per queue: whom it served, what waits
        self._writer = OutcomeWriter(self._held, host.tokenizer, self._release, finished=finished,
                                     backoff=backoff or Backoff())
        self._watcher = AttemptWatcher(host, sessions, worker_id, self._in_flight, poll_s=cancel_poll_s)
        self._stopping = threading.Event()  # no more claims; set first thing at shutdown
        self._submitter = AttemptSubmitter(host, self._in_flight, self._writer, streamer=self._streamer,
                                           adapters=adapters, stopping=self._stopping.is_set)
        self._shutdown_lock = threading.Lock()
        self._shut_down = False

    @property
    def limits(self) -> dict[str, int]:
        """lane (core/lanes.py: this worker's model's queue) -> max_running in this worker; a lane not
        named: no hold. The engine's request class is the lane's queue."""
        return self.queue_room.limits

    def start(self) -> None:
        self.host.on_step_end(self._writer.step_ended)
        self._writer.start()
        self._watcher.start()

    # --- taking a job ------------------------------------------------------------------------------------

    def run(self, job_id: str, on_done: OnDone) -> bool:
        """`run_many` of one job."""
        return self.run_many([(job_id, on_done)])[0]

    def run_many(self, requests: list[tuple[str, OnDone]]) -> list[bool]:
        """Claims the jobs in one statement and submits those it got; per request, whether it started.
        A job not started (done, cancelled, expired or already running: not ours to run) never calls its
        on_done.

        Raises RunnerStoppedError once shutdown has begun, and store errors as they come.
        """
        self._check_not_stopping()
        with self._in_flight.claiming():
            with self._held() as session:
                claimed = jobs.claim_many(session, [job_id for job_id, _ in requests], self.worker_id,
                                          utcnow())
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

    def run_next(self, queue: str, on_dones: list[OnDone]) -> list[str]:
        """Claims up to len(on_dones) jobs of `queue` in fair order (core/store/fair_share.py: whichever
        jobs are next, not named ones) and starts them, the i-th with on_dones[i]. Returns the ids of those
        that started, in that order: on_dones beyond them are never called.

        Raises RunnerStoppedError once shutdown has begun, and store errors as they come.
        """
        self._check_not_stopping()
        state = self._fair.setdefault(queue, FairState())
        with self._in_flight.claiming():
            with self._held() as session:
                claimed = fair_share.claim_fair(session, queue, len(on_dones), self.worker_id, utcnow,
                                                self._tenant_defaults, state,
                                                by_arrival=self.host.config.scheduling == "arrival")
            salts = {job.tenant_id: tenants.cache_salt(job.tenant_id, job.cache_namespace) for job in claimed}
            self._start_all(list(zip(claimed, on_dones, strict=False)), salts)
        return [job.id for job in claimed]

    def _check_not_stopping(self) -> None:
        if self._stopping.is_set():
            raise RunnerStoppedError("the runner is shutting down")

    def _start_all(self, claimed: list[tuple[Job | ClaimedJob, OnDone]], salts: dict[str, str]) -> None:
        """Puts every claimed attempt in flight first, then submits them one by one (a submit compiles
        nothing: a new schema compiles on the engine host's compile thread), since the reconciler requeues a
        claim its worker does not hold once it is older than dispatch_grace_s. `salts`: each tenant's
        prefix-cache salt, read with the claim."""
        attempts = [Attempt.of(job, on_done, salts[job.tenant_id], time.monotonic())
                    for job, on_done in claimed]
        for attempt in attempts:
            self._in_flight.add(attempt)
        for (job, _), attempt in zip(claimed, attempts, strict=True):
            self._submitter.submit(job, attempt)

    # --- writer thread -----------------------------------------------------------------------------------

    def _release(self, attempt: Attempt) -> None:
        """Its outcome is written (or given up on): out of flight, its stream ended, its caller told."""
        self._in_flight.remove(attempt)
        if self._streamer is not None:
            self._streamer.end(attempt.job_id, attempt.attempt)
        try:
            attempt.on_done()
        except Exception:
            log.exception("on_done failed for job %s", attempt.job_id)

    # --- room and attempts in flight ---------------------------------------------------------------------

    def has_room(self, queue: str) -> bool:
        return self.queue_room.has_room(queue)

    def wait_for_room(self, queue: str, timeout_s: float) -> bool:
        return self.queue_room.wait_for_room(queue, timeout_s)

    def room(self, queue: str) -> int:
        return self.queue_room.room(queue)

    @property
    def num_running(self) -> int:
        return len(self._in_flight)

    def held_attempts(self) -> set[tuple[str, int]]:
        """(job id, attempt) of every attempt in flight here, its outcome written or not."""
        return self._in_flight.held()

    def claims_since(self) -> datetime | None:
        """When the oldest claim not yet in flight here began (None: none is on its way)."""
        return self._in_flight.claims_since()

    def stopping(self) -> bool:
        """Whether shutdown began: no more claims, and this runner requeues its own jobs on the way out."""
        return self._stopping.is_set()

    def wait_idle(self, timeout_s: float, tick: Callable[[], None] | None = None) -> bool:
        """Waits until no job is in flight, calling `tick` (e.g. flush acks) every 0.1 s in this thread."""
        return self._in_flight.wait_idle(timeout_s, tick)

    # --- shutdown ----------------------------------------------------------------------------------------

    def shutdown(
        self, grace_s: float, publish: Publish | None, tick: Callable[[], None] | None = None
    ) -> list[str]:
        """Stops taking jobs (and watching them), lets in-flight ones finish within grace_s, then aborts the
        rest and puts them back in the queue (running -> queued in the store, then re-published). Returns
        the requeued ids. Idempotent: a second call does nothing."""
        self._stopping.set()
        self._watcher.request_stop()
        with self._shutdown_lock:
            if self._shut_down:
                return []
            self._shut_down = True
        requeued = [] if self.wait_idle(grace_s, tick) else self._hand_back(tick)
        self._writer.abandon()
        self.host.remove_step_listener(self._writer.step_ended)
        self._writer.stop()
        if tick is not None:
            tick()
        self._watcher.join()
        self._held.release()
        if publish is not None and requeued:
            publish_and_mark(self._sessions, publish, requeued)
        return [job_id for job_id, _ in requeued]

    def _hand_back(self, tick: Callable[[], None] | None) -> list[tuple[str, str]]:
        """After the grace period: aborts what is still in flight and requeues this worker's jobs."""
        for attempt in self._in_flight.snapshot():
            self._watcher.abort(attempt, SHUTDOWN)
        if not self.wait_idle(ABORT_WAIT_S, tick):
            self._writer.abandon()  # the store is down: unwritten outcomes are left to the fleet
        return self._requeue_own_jobs()

    def _requeue_own_jobs(self) -> list[tuple[str, str]]:
        try:
            with self._sessions() as session:
                requeued = jobs.requeue_orphans(session, [self.worker_id], utcnow())
        except OperationalError as exc:
            log.error("shutdown: could not requeue unfinished jobs (%s); another worker's reconciler will, "
                      "once this worker's heartbeat is overdue", describe(exc))
            return []
        log.warning("shutdown: requeued %d unfinished job(s)", len(requeued))
        return requeued
