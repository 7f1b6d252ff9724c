"""The bridge between the job store and one EngineHost, shared by the Celery worker and the embedded runtime.

A job id comes in (from a broker message or an in-process queue); the runner claims the row (a conditional
UPDATE, so a duplicate or late message is dropped), makes it an attempt (worker/attempt.py) in flight here
and hands its requests to the engine (worker/engine_requests.py: a request per choice of a generation job,
gathered as worker/choices.py does, or per input of an embedding job, with the same gathering). The jobs
handed over together are claimed in one statement. The rest is done by parts of their own:
- the outcome writer (worker/outcome_writer.py) stores what each engine step produced in one transaction,
  then releases the attempts it ended (the runner's `_release`: out of flight, the caller acks);
- the attempt watcher (worker/attempt_watcher.py) aborts cancelled, timed-out and superseded attempts;
- each queue's room (worker/queue_room.py): `has_room(queue)` / `wait_for_room(queue, ...)` say whether
  fewer than the queue's `max_running` jobs of it are in flight in this worker; the Celery consumer and the
  embedded feeders take a job only when there is room.

An attempt whose engine step ran out of device memory is submitted once more, within the same attempt,
before its failure is written (worker/transient.py says which errors qualify).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import datetime
from functools import partial

from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.clock import utcnow
from conveyor.core.lanes import queue_of
from conveyor.core.protocol.job_kinds import EMBEDDING
from conveyor.core.retry_policy import MODEL_UNAVAILABLE, Backoff
from conveyor.core.seams.dispatch import Publish, publish_and_mark
from conveyor.core.seams.finish_notifications import FinishedSink
from conveyor.core.seams.token_stream import TokenSink
from conveyor.core.store import fair_share, jobs, tenants
from conveyor.core.store.fair_share import FairState
from conveyor.core.store.tables import Job
from conveyor.core.store.tenants import TenantLimits
from conveyor.engine.host import EngineHost
from conveyor.engine.outputs import RequestOutput
from conveyor.worker.adapters import RuntimeAdapters
from conveyor.worker.attempt import ENGINE_ERROR, INVALID_REQUEST, SHUTDOWN, Attempt, EngineFuture, OnDone
from conveyor.worker.attempt_outcome import describe, to_datetime
from conveyor.worker.attempt_watcher import AttemptWatcher
from conveyor.worker.chat_prompt import chat_prompt_ids
from conveyor.worker.choices import gather_choices
from conveyor.worker.engine_requests import (
    EngineRequests,
    embedding_requests,
    generation_requests,
    pooling_params_from_json,
)
from conveyor.worker.in_flight import InFlight
from conveyor.worker.outcome_writer import OutcomeWriter
from conveyor.worker.queue_room import QueueRoom
from conveyor.worker.sampling import sampling_params_from_json
from conveyor.worker.streamer import JobStreamer
from conveyor.worker.transient import is_transient

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
        self._adapters = adapters  # LoRA adapters loaded at run time, read when a job first names one
        self.worker_id = worker_id
        self._sessions = sessions
        self._streamer = JobStreamer(tokens) if tokens is not None else None  # text deltas to the API
        self._tenant_defaults = tenant_defaults or TenantLimits()  # weights and max_running, fair claims
        self._in_flight = InFlight()
        self.queue_room = QueueRoom(limits or {}, self._in_flight)
        self._fair = {name: FairState() for name in self.limits}  # per queue: whom it served, what waits
        self._writer = OutcomeWriter(sessions, host.tokenizer, self._release, finished=finished,
                                     backoff=backoff or Backoff())
        self._watcher = AttemptWatcher(host, sessions, worker_id, self._in_flight, poll_s=cancel_poll_s)
        self._stopping = threading.Event()  # no more claims; set first thing at shutdown
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
            with self._sessions() as session:
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

    def run_next(self, queue: str, on_dones: list[OnDone]) -> int:
        """Claims up to len(on_dones) jobs of `queue` in fair order (core/store/fair_share.py: whichever
        jobs are next, not named ones) and starts them, the i-th with on_dones[i]. Returns how many started:
        on_dones beyond that are never called.

        Raises RunnerStoppedError once shutdown has begun, and store errors as they come.
        """
        self._check_not_stopping()
        state = self._fair.setdefault(queue, FairState())
        with self._in_flight.claiming():
            with self._sessions() as session:
                claimed = fair_share.claim_fair(session, queue, len(on_dones), self.worker_id, utcnow,
                                                self._tenant_defaults, state,
                                                by_arrival=self.host.config.scheduling == "arrival")
                salts = tenants.cache_salts(session, [job.tenant_id for job in claimed])
            self._start_all(list(zip(claimed, on_dones, strict=False)), salts)
        return len(claimed)

    def _check_not_stopping(self) -> None:
        if self._stopping.is_set():
            raise RunnerStoppedError("the runner is shutting down")

    def _start_all(self, claimed: list[tuple[Job, OnDone]], salts: dict[str, str]) -> None:
        """Puts every claimed attempt in flight first, then submits them one by one (a submit compiles
        nothing: a new schema compiles on the engine host's compile thread), since the reconciler requeues a
        claim its worker does not hold once it is older than dispatch_grace_s. `salts`: each tenant's
        prefix-cache salt, read with the claim."""
        attempts = [Attempt.of(job, on_done, salts[job.tenant_id], time.monotonic())
                    for job, on_done in claimed]
        for attempt in attempts:
            self._in_flight.add(attempt)
        for (job, _), attempt in zip(claimed, attempts, strict=True):
            self._submit(job, attempt)

    def _submit(self, job: Job, attempt: Attempt) -> None:
        try:
            if attempt.lora is not None and self._adapters is not None:
                self._adapters.ensure(attempt.lora)
        except ValueError as exc:  # no such adapter for this model: the request's own error
            self._writer.refused(attempt, INVALID_REQUEST, str(exc))
            return
        except Exception as exc:  # its files unreadable for now: the retry policy's (core/retry_policy.py)
            log.warning("job %s: adapter %s not loadable: %s", job.id, attempt.lora, describe(exc))
            self._writer.refused(attempt, MODEL_UNAVAILABLE, f"adapter {attempt.lora}: {describe(exc)}")
            return
        try:
            attempt.engine_input = self._engine_input(job, attempt.n)
            future = self._to_engine(attempt)
        except ValueError as exc:
            self._writer.refused(attempt, INVALID_REQUEST, str(exc))
            return
        except Exception as exc:
            log.exception("engine refused job %s", job.id)
            self._writer.refused(attempt, ENGINE_ERROR, describe(exc))
            return
        future.add_done_callback(lambda f: self._ended(attempt, f))

    def _to_engine(self, attempt: Attempt) -> EngineFuture:
        if attempt.n == 1:
            return self._to_engine_choice(attempt, 0)
        # NOTE: this group's ids, taken now: when one request fails, the group's failure may resubmit the
        # attempt (a retry, under new ids) before the group cancels its other requests.
        request_ids = attempt.request_ids()
        return gather_choices(attempt.n, partial(self._to_engine_choice, attempt),
                              cancel_all=lambda: self._cancel_requests(request_ids))

    def _to_engine_choice(self, attempt: Attempt, index: int) -> Future[RequestOutput]:
        """The attempt's request `index`: a choice of its prompt, or one of its inputs."""
        requests = attempt.engine_input
        assert requests is not None and len(requests) == attempt.n
        request_class = queue_of(attempt.queue)  # the engine's class of the lane's queue
        on_update = None if attempt.embeds else lambda out: self._on_update(attempt, index, out)  # no text
        return self.host.submit(attempt.request_ids()[index], requests.prompts[index], requests.params[index],
                                request_class, on_update=on_update, cache_salt=attempt.cache_salt,
                                urgency=attempt.urgency, lora=attempt.lora,
                                on_admitted=lambda: self._in_flight.admitted(attempt))

    def _cancel_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.host.cancel(request_id)

    def _engine_input(self, job: Job, n: int) -> EngineRequests:
        """The engine requests of the job: its `n` choices, or an embedding job's inputs. ValueError naming
        the field for what the engine refuses."""
        if job.kind == EMBEDDING:
            if not job.inputs:
                raise ValueError("input: the embedding job has no inputs")
            return embedding_requests(job.inputs, pooling_params_from_json(job.params or {}))
        params = sampling_params_from_json(job.params or {})
        if job.messages is not None:
            prompt_ids = chat_prompt_ids(self.host.tokenizer, job.messages, job.chat)
            return generation_requests(prompt_ids, params, n)
        if job.prompt is None:
            raise ValueError("prompt: the job has neither a prompt nor messages")
        return generation_requests(job.prompt, params, n)

    # --- engine thread -----------------------------------------------------------------------------------

    def _on_update(self, attempt: Attempt, index: int, out: RequestOutput) -> None:
        if self._streamer is not None:
            self._streamer.update(attempt.job_id, attempt.attempt, out, index)
        if attempt.first_token_seen or out.metrics.first_token_time is None:
            return
        attempt.first_token_seen = True
        at = to_datetime(out.metrics.first_token_time)
        assert at is not None
        self._writer.first_token(attempt, at)

    def _ended(self, attempt: Attempt, future: EngineFuture) -> None:
        if not self._retried_once(attempt, future):
            self._writer.ended(attempt, future)

    def _retried_once(self, attempt: Attempt, future: EngineFuture) -> bool:
        """Submits the attempt again, once, after a transient engine error (worker/transient.py), under a new
        request id (the failed one's abort output is still being delivered in this step); the store sees
        one attempt. False when it is not retried: the failure is then written as usual."""
        error = future.exception()
        if (error is None or attempt.retried or attempt.engine_input is None
                or attempt.abort_reason is not None or self._stopping.is_set() or not is_transient(error)):
            return False
        attempt.retried = True
        log.warning("job %s attempt %d: %s; retrying it once on this worker", attempt.job_id, attempt.attempt,
                    describe(error))
        self._in_flight.rekey(attempt, f"{attempt.request_id}~retry")
        try:
            retry = self._to_engine(attempt)
        except Exception:
            log.exception("job %s: the retry was refused", attempt.job_id)
            return False
        retry.add_done_callback(lambda f: self._ended(attempt, f))
        return True

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
