"""Embedded mode: API, worker and engine in one process, with an in-process queue instead of a broker.

Same services and semantics as the Celery worker (worker/services.py): one engine; at most max_running jobs of
each queue handed to it at once (one feeder thread per queue, waiting on the job runner's per-queue hold);
claim, late "ack" (the hold is released when the job ends), cancel polling, timeouts; and the reconciler.
Restarts are safe: jobs left queued in the database by a previous run are loaded into the in-process queues
at start.
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

from core.background import BackgroundLoop
from core.finish_notifications import LocalFinishedHub
from core.settings import Settings
from core.store import jobs
from core.store.database import make_db_engine, make_session_factory
from engine.host import EngineHost
from worker.cold_start import ColdStart
from worker.heartbeat import new_worker_id
from worker.in_process_queue import InProcessPublisher
from worker.job_runner import RunnerStoppedError
from worker.services import WorkerServices
from worker.token_sinks import InProcessTokenStream

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
        self.publisher = InProcessPublisher(list(settings.queues))
        self.token_stream = InProcessTokenStream()  # running jobs' text, to the API (create_app)
        self.finished = LocalFinishedHub()  # finished jobs, to the API's waiters (create_app: watch and sink)
        self.worker_id = new_worker_id("embedded")
        self.cold_start = cold_start if cold_start is not None else ColdStart()
        self._sessions = sessions if sessions is not None else make_session_factory(
            make_db_engine(settings.database_url)
        )
        self._services = WorkerServices(settings, self._sessions, self.publisher, self.worker_id,
                                        tokens=self.token_stream, republish_requeued=False,
                                        finished=self.finished)
        self._stop = threading.Event()  # every feeder's
        self._feeders = [BackgroundLoop(f"feeder-{name}", self._feeder_of(name)) for name in settings.queues]

    @property
    def sessions(self) -> sessionmaker[Session]:
        """The runtime's db engine's sessions: the embedded API shares them (SQLite's writer queue is per
        db engine, core/store/database.py)."""
        return self._sessions

    @property
    def host(self) -> EngineHost:
        return self._services.host

    @property
    def metrics_registry(self) -> CollectorRegistry:
        """The engine's metrics, served on the embedded server's own /metrics (api.app's MetricsSource)."""
        return self._services.metrics.registry

    def start(self) -> None:
        self._load_backlog()  # before the reconciler starts, so no job is published twice
        self._services.start()
        self._services.metrics.track_cold_start(self.cold_start)
        self.cold_start.engine_ready(self.host)
        self.cold_start.watch_first_token(self.host)
        for feeder in self._feeders:
            feeder.start()

    def stop(self, grace_s: float | None = None) -> None:
        """Stops taking jobs, finishes in-flight ones within grace_s (default: the worker_shutdown_grace_s
        setting); the rest go back to queued in the store (the next start picks them up)."""
        self._stop.set()
        for name in self.settings.queues:
            self.publisher.wake(name)
        for feeder in self._feeders:
            feeder.join()
        self._services.stop(grace_s)

    def _load_backlog(self) -> None:
        """Every queued job in the store, oldest first: the in-process queues start empty."""
        with self._sessions() as session:
            rows = jobs.queued(session)
        for job_id, queue in rows:
            if queue in self.publisher.queues:
                self.publisher.publish(job_id, queue)
        if rows:
            log.info("loaded %d queued job(s) from the store", len(rows))

    def _feeder_of(self, queue_name: str) -> Callable[[threading.Event], None]:
        """A feeder loop for one queue; all stop on the runtime's one stop flag (_feed reads it)."""
        return lambda _own_stop: self._feed(queue_name)

    def _feed(self, queue_name: str) -> None:
        """Whenever this queue has room, claims as many of its jobs as fit, in fair order
        (core/store/fair_share.py); with nothing to claim, waits to be woken: by a submit's publish, by a
        job of this queue ending (a tenant held at its max_running may start another), by stop, or after
        IDLE_POLL_S."""
        runner = self._services.runner
        wakeups = self.publisher.queues[queue_name]
        room_freed = functools.partial(self.publisher.wake, queue_name)
        while not self._stop.is_set():
            if not runner.wait_for_room(queue_name, POLL_S):
                continue
            _take_waiting(wakeups, sys.maxsize)  # the claim below sees every job they announced
            wanted = min(runner.room(queue_name), CLAIM_MAX)
            try:
                started = runner.run_next(queue_name, [room_freed] * wanted)
            except RunnerStoppedError:
                return
            except Exception:
                log.exception("could not claim jobs of %s; they stay queued", queue_name)
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
