"""Embedded mode: API, worker and engine in one process, with an in-process queue instead of a broker.

Same semantics as the Celery worker: one engine; at most max_running jobs of each queue handed to it at once
(one feeder thread per queue holding that many slots); claim, late "ack" (the slot is released when the job
ends), cancel polling, timeouts; and the reconciler, which also makes restarts safe: jobs left queued in the
database by a previous run are loaded into the in-process queues at start.
"""

from __future__ import annotations

import logging
import queue as stdlib_queue
import threading
import time

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from api.settings import Settings
from api.store.db import make_engine, make_session_factory
from api.store.models import QUEUED, Job
from engine.host import EngineHost
from worker.batches.runner import BatchRunner, make_batch_runner
from worker.dispatch import InProcessPublisher
from worker.heartbeat import Heartbeat, new_worker_id
from worker.job_runner import JobRunner, OnDone, RunnerStoppedError
from worker.model import engine_config, resolve_model
from worker.reconciler import Reconciler
from worker.token_stream import InProcessTokenStream
from worker.webhooks.sender import WebhookSender

log = logging.getLogger(__name__)

POLL_S = 0.2  # how often an idle feeder looks at the stop flag
STORE_ERROR_BACKOFF_S = 1.0


class EmbeddedRuntime:
    def __init__(self, settings: Settings, *, sessions: sessionmaker[Session] | None = None) -> None:
        self.settings = settings
        self.publisher = InProcessPublisher(list(settings.queues))
        self.token_stream = InProcessTokenStream()  # running jobs' text, to the API (create_app)
        self.worker_id = new_worker_id("embedded")
        self._sessions = sessions if sessions is not None else make_session_factory(
            make_engine(settings.database_url)
        )
        self._stop = threading.Event()
        self._feeders: list[threading.Thread] = []
        self._host: EngineHost | None = None
        self._runner: JobRunner | None = None
        self._batches: BatchRunner | None = None
        self._heartbeat = Heartbeat(self._sessions, self.worker_id, list(settings.queues),
                                    settings.worker_heartbeat_s)
        self._reconciler = Reconciler(self._sessions, self.publisher, settings)
        self._webhooks = WebhookSender(self._sessions, settings)

    @property
    def host(self) -> EngineHost:
        assert self._host is not None, "EmbeddedRuntime.start() has not run"
        return self._host

    def start(self) -> None:
        self._host = EngineHost.from_config(engine_config(self.settings, resolve_model(self.settings)))
        self._runner = JobRunner(self._host, self._sessions, self.worker_id,
                                 cancel_poll_s=self.settings.cancel_poll_s, tokens=self.token_stream)
        self._heartbeat.start()
        self._runner.start()
        self._load_backlog()
        for name, queue in self.settings.queues.items():
            thread = threading.Thread(target=self._feed, args=(name, queue.max_running),
                                      name=f"feeder-{name}", daemon=True)
            thread.start()
            self._feeders.append(thread)
        self._reconciler.start()
        self._webhooks.start()
        self._batches = make_batch_runner(self._sessions, self.settings, self.publisher.publish,
                                          self.worker_id, self._host.tokenizer)
        self._batches.start()

    def stop(self, grace_s: float | None = None) -> None:
        """Stops taking jobs, finishes in-flight ones within grace_s (default: the worker_shutdown_grace_s
        setting); the rest go back to queued in the store (the next start picks them up)."""
        self._stop.set()
        for thread in self._feeders:
            thread.join()
        if self._batches is not None:
            self._batches.stop()
        self._reconciler.stop()
        if self._runner is not None:
            grace = grace_s if grace_s is not None else self.settings.worker_shutdown_grace_s
            self._runner.shutdown(grace, publish=None)
        self._webhooks.stop()
        self._heartbeat.stop()
        if self._host is not None:
            self._host.shutdown()

    def _load_backlog(self) -> None:
        """Every queued job in the store, oldest first: the in-process queues start empty."""
        with self._sessions() as session:
            rows = session.execute(
                select(Job.id, Job.queue).where(Job.status == QUEUED).order_by(Job.created_at)
            ).all()
        for job_id, queue in rows:
            if queue in self.publisher.queues:
                self.publisher.publish(job_id, queue)
        if rows:
            log.info("loaded %d queued job(s) from the store", len(rows))

    def _feed(self, queue_name: str, max_running: int) -> None:
        """Hands this queue's jobs to the runner, never more than max_running of them in flight at once."""
        assert self._runner is not None
        slots = threading.BoundedSemaphore(max_running)
        pending = self.publisher.queues[queue_name]
        while not self._stop.is_set():
            if not slots.acquire(timeout=POLL_S):
                continue
            try:
                job_id = pending.get(timeout=POLL_S)
            except stdlib_queue.Empty:
                slots.release()
                continue
            if not self._run(job_id, queue_name, slots.release):
                slots.release()

    def _run(self, job_id: str, queue_name: str, on_done: OnDone) -> bool:
        assert self._runner is not None
        try:
            return self._runner.run(job_id, on_done=on_done)
        except RunnerStoppedError:
            return False
        except Exception:
            log.exception("could not start job %s; it stays queued", job_id)
            time.sleep(STORE_ERROR_BACKOFF_S)
            self.publisher.publish(job_id, queue_name)
            return False
