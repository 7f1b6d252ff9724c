"""Publishing job ids to a queue: Celery's broker (Redis) or an in-process queue in embedded mode.

Messages carry only the job id; the store is the source of truth. A publish may fail (broker down): the job
then stays undispatched and the reconciler re-publishes it (see worker/reconciler.py).
"""

from __future__ import annotations

import logging
import queue as stdlib_queue
from collections.abc import Callable

from celery import Celery
from kombu import Exchange, Queue
from sqlalchemy.orm import Session, sessionmaker

from api.settings import Settings
from api.store import jobs
from api.store.models import utcnow

log = logging.getLogger(__name__)

Publish = Callable[[str, str], None]  # (job_id, queue)
PUBLISH_RETRY = {"max_retries": 2, "interval_start": 0.0, "interval_step": 0.2, "interval_max": 0.5}


def job_queue(name: str) -> Queue:
    """The broker queue of one job queue: a durable queue bound to a direct exchange of the same name."""
    return Queue(name, Exchange(name, type="direct", durable=True), routing_key=name, durable=True)


def job_message(job_id: str) -> dict[str, str]:
    return {"job_id": job_id}


class CeleryPublisher:
    """Publishes job ids through the Celery app's producer pool (thread-safe, one connection per caller)."""

    def __init__(self, settings: Settings, app: Celery | None = None) -> None:
        from worker.celery_app import make_celery_app

        self._app = app if app is not None else make_celery_app(settings)
        self._queues = {name: job_queue(name) for name in settings.queues}

    def publish(self, job_id: str, queue: str) -> None:
        if queue not in self._queues:
            raise ValueError(f"queue: unknown queue {queue!r}; known: {sorted(self._queues)}")
        with self._app.producer_pool.acquire(block=True, timeout=5) as producer:
            producer.publish(
                job_message(job_id), exchange=self._queues[queue].exchange, routing_key=queue,
                declare=[self._queues[queue]], serializer="json", delivery_mode="persistent",
                retry=True, retry_policy=PUBLISH_RETRY,
            )

    def ping(self) -> bool:
        try:
            with self._app.connection_for_write() as conn:
                conn.ensure_connection(max_retries=1, interval_start=0, timeout=2)
            return True
        except Exception as exc:
            log.debug("broker ping failed: %s", exc)
            return False

    def depth(self, queue: str) -> int:
        """Messages waiting in the broker's queue (not those delivered and unacknowledged)."""
        with self._app.connection_for_write() as conn, conn.channel() as channel:
            declared = self._queues[queue].bind(channel).queue_declare()
            return int(declared.message_count) if declared is not None else 0

    def close(self) -> None:
        self._app.pool.force_close_all()


class InProcessPublisher:
    """Embedded mode: one in-process FIFO per queue, drained by EmbeddedRuntime."""

    def __init__(self, queue_names: list[str]) -> None:
        self.queues: dict[str, stdlib_queue.SimpleQueue[str]] = {
            name: stdlib_queue.SimpleQueue() for name in queue_names
        }

    def publish(self, job_id: str, queue: str) -> None:
        if queue not in self.queues:
            raise ValueError(f"queue: unknown queue {queue!r}; known: {sorted(self.queues)}")
        self.queues[queue].put(job_id)

    def depth(self, queue: str) -> int:
        return self.queues[queue].qsize()

    def ping(self) -> bool:
        return True


def publish_and_mark(
    sessions: sessionmaker[Session], publish: Publish, pending: list[tuple[str, str]]
) -> int:
    """Publishes (job_id, queue) pairs in order and marks the published ones dispatched. Stops at the first
    failure (the broker is likely down): the rest stay undispatched for the next reconcile. Returns how
    many went out."""
    sent: list[str] = []
    for job_id, queue in pending:
        try:
            publish(job_id, queue)
        except Exception as exc:
            log.warning("publish of %s to %s failed (%s: %s); the reconciler will retry",
                        job_id, queue, type(exc).__name__, exc)
            break
        sent.append(job_id)
    if sent:
        with sessions() as session:
            jobs.mark_dispatched(session, sent, utcnow())
    return len(sent)
