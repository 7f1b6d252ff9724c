"""Embedded mode: API, workers and engines in one process, with an in-process queue instead of a broker.

Same services and semantics as the Celery worker (worker/services.py), once per served model: one engine
each; at most max_running jobs of each lane (a model's queue, core/lanes.py) handed to it at once (one
feeder thread per lane, waiting on the job runner's per-lane hold); claim, late "ack" (the hold is released
when the job ends), cancel polling, timeouts. The fleet's own duties (the reconciler, webhook sending, batch
runs) run once, with the first model's services. Restarts are safe: jobs left queued in the database by a
previous run are loaded into the in-process queues at start.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue as stdlib_queue
import sys
import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.background import BackgroundLoop
from conveyor.core.seams.finish_notifications import LocalFinishedHub
from conveyor.core.settings import Settings
from conveyor.core.store import jobs
from conveyor.core.store.database import make_db_engine, make_session_factory
from conveyor.engine.host import EngineHost
from conveyor.worker.cold_start import ColdStart
from conveyor.worker.engine_metrics import by_model
from conveyor.worker.heartbeat import new_worker_id
from conveyor.worker.in_process_queue import InProcessPublisher
from conveyor.worker.job_runner import RunnerStoppedError
from conveyor.worker.services import WorkerServices
from conveyor.worker.token_sinks import InProcessTokenStream

log = logging.getLogger(__name__)

POLL_S = 0.2  # how often a feeder waiting for room looks at the stop flag
IDLE_POLL_S = 2.0  # how often a feeder with nothing to claim looks again unwoken (a safety net)
STORE_ERROR_BACKOFF_S = 1.0
CLAIM_MAX = 512  # jobs one claim takes at most


class EmbeddedRuntime:
    def __init__(self, settings: Settings, *, sessions: sessionmaker[Session] | None = None,
                 cold_start: ColdStart | None = None) -> None:
        """`cold_start`: made by the caller when its imports were done (else now)."""
        self.settings = settings
        self.publisher = InProcessPublisher(settings.lanes())
        self.token_stream = InProcessTokenStream()  # running jobs' text, to the API (create_app)
        self.finished = LocalFinishedHub()  # finished jobs, to the API's waiters (create_app: watch and sink)
        self.cold_start = cold_start if cold_start is not None else ColdStart()
        self._sessions = sessions if sessions is not None else make_session_factory(
            make_db_engine(settings.database_url)
        )
        # One worker per served model, the default first: it alone runs the fleet's duties.
        self.models = {
            model_id: WorkerServices(
                model_settings, self._sessions, self.publisher, new_worker_id("embedded"),
                tokens=self.token_stream, republish_requeued=False, finished=self.finished,
                fleet_duties=index == 0)
            for index, (model_id, model_settings) in enumerate(settings.served().items())
        }
        self._metrics = by_model({model_id: services.metrics.registry
                                  for model_id, services in self.models.items()})
        self._stop = threading.Event()  # every feeder's
        self._feeders = [BackgroundLoop(f"feeder-{lane}", self._feeder_of(services, lane))
                         for services in self.models.values() for lane in services.lanes]

    @property
    def sessions(self) -> sessionmaker[Session]:
        """The runtime's db engine's sessions: the embedded API shares them (SQLite's writer queue is per
        db engine, core/store/database.py)."""
        return self._sessions

    @property
    def _default(self) -> WorkerServices:
        return next(iter(self.models.values()))

    @property
    def worker_id(self) -> str:
        """The default model's worker."""
        return self._default.worker_id

    @property
    def host(self) -> EngineHost:
        """The default model's engine."""
        return self._default.host

    @property
    def metrics_registry(self) -> CollectorRegistry:
        """Every model's engine metrics, labelled by model, served on the embedded server's own /metrics
        (conveyor.api.app's MetricsSource)."""
        return self._metrics

    def start(self) -> None:
        self._load_backlog()  # before the reconciler starts, so no job is published twice
        for services in self.models.values():
            services.start()
        self._default.metrics.track_cold_start(self.cold_start)
        self.cold_start.engine_ready(self.host)
        self.cold_start.watch_first_token(self.host)
        for feeder in self._feeders:
            feeder.start()

    def stop(self, grace_s: float | None = None) -> None:
        """Stops taking jobs, finishes in-flight ones within grace_s (default: the worker_shutdown_grace_s
        setting); the rest go back to queued in the store (the next start picks them up)."""
        self._stop.set()
        for lane in self.publisher.queues:
            self.publisher.wake(lane)
        for feeder in self._feeders:
            feeder.join()
        for services in self.models.values():
            services.stop(grace_s)

    def _load_backlog(self) -> None:
        """Every queued job in the store, oldest first: the in-process queues start empty."""
        with self._sessions() as session:
            rows = jobs.queued(session)
        for job_id, lane in rows:
            if lane in self.publisher.queues:
                self.publisher.publish(job_id, lane)
        if rows:
            log.info("loaded %d queued job(s) from the store", len(rows))

    def _feeder_of(self, services: WorkerServices, lane: str) -> Callable[[threading.Event], None]:
        """A feeder loop for one lane; all stop on the runtime's one stop flag (_feed reads it)."""
        return lambda _own_stop: self._feed(services, lane)

    def _feed(self, services: WorkerServices, lane: str) -> None:
        """Whenever this lane has room, claims as many of its jobs as fit, in fair order
        (core/store/fair_share.py); with nothing to claim, waits to be woken: by a submit's publish, by a
        job of this lane ending (a tenant held at its max_running may start another), by stop, or after
        IDLE_POLL_S."""
        runner = services.runner
        wakeups = self.publisher.queues[lane]
        room_freed = functools.partial(self.publisher.wake, lane)
        while not self._stop.is_set():
            if not runner.wait_for_room(lane, POLL_S):
                continue
            _take_waiting(wakeups, sys.maxsize)  # the claim below sees every job they announced
            wanted = min(runner.room(lane), CLAIM_MAX)
            try:
                started = len(runner.run_next(lane, [room_freed] * wanted))
            except RunnerStoppedError:
                return
            except Exception:
                log.exception("could not claim jobs of %s; they stay queued", lane)
                time.sleep(STORE_ERROR_BACKOFF_S)
                continue
            if started < wanted:  # it took all there was: claim again once a job is announced or room freed,
                with contextlib.suppress(stdlib_queue.Empty):  # not at once for nothing
                    wakeups.get(timeout=IDLE_POLL_S)


def _take_waiting(pending: stdlib_queue.SimpleQueue[str], limit: int) -> list[str]:
    """Up to `limit` ids already waiting, without blocking."""
    taken: list[str] = []
    while len(taken) < limit:
        try:
            taken.append(pending.get_nowait())
        except stdlib_queue.Empty:
            break
    return taken
