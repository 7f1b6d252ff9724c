"""The broker's queues and publishing to them with kombu (the messaging library under Celery).

One durable queue per lane (a model's queue, `MODEL:QUEUE`: core/lanes.py), bound to a direct exchange of the
same name; a message is `{"job_id": ...}` (the store is the truth). The API publishes here without loading
Celery; the worker's Celery app (worker/celery_app.py) consumes the same queues with the same connection
settings.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import redis
from kombu import Connection, Exchange, Queue
from kombu.pools import ProducerPool

from conveyor.core.settings import Settings

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0
POOL_LIMIT = 8  # connections (and producers) one process keeps to the broker
ACQUIRE_TIMEOUT_S = 5.0
PUBLISH_RETRY = {"max_retries": 2, "interval_start": 0.0, "interval_step": 0.2, "interval_max": 0.5}
# A message held by a worker that died is restored after this long; the reconciler requeues the job much
# sooner (worker_dead_after_s), and the late duplicate is dropped at claim.
TRANSPORT_OPTIONS: dict[str, Any] = {"visibility_timeout": 3600}
# Lives in the broker beside the queues, so it vanishes exactly when they do (a Redis restarted without its
# data): finding it missing means every message published before now may be gone.
EPOCH_KEY = "conveyor:broker-epoch"


def job_queue(name: str) -> Queue:
    """The broker queue of one lane: a durable queue bound to a direct exchange of the same name."""
    return Queue(name, Exchange(name, type="direct", durable=True), routing_key=name, durable=True)


def job_message(job_id: str) -> dict[str, str]:
    return {"job_id": job_id}


class BrokerPublisher:
    """Publishes job ids from a pool of producers (thread-safe: one connection per caller at a time)."""

    def __init__(self, settings: Settings) -> None:
        if settings.broker_url is None:
            raise ValueError("broker_url: publishing to a broker needs one (unset means embedded mode)")
        self._connection = Connection(settings.broker_url, connect_timeout=CONNECT_TIMEOUT_S,
                                      transport_options=dict(TRANSPORT_OPTIONS))
        self._connections = self._connection.Pool(limit=POOL_LIMIT)
        self._producers = ProducerPool(self._connections, limit=POOL_LIMIT)
        self._queues = {lane: job_queue(lane) for lane in settings.lanes()}
        self._declared: set[str] = set()  # lanes this process has published to (and declared)
        self._redis = _redis_client(settings.broker_url)

    def publish(self, job_id: str, queue: str) -> None:
        if queue not in self._queues:
            raise ValueError(f"queue: unknown lane {queue!r}; known: {sorted(self._queues)}")
        # Through the default exchange, which routes by queue name: on Redis, kombu otherwise reads the named
        # exchange's bindings from Redis again at every publish (a round trip and a new client each time).
        # The queue is declared with this process's first publish to it, not at each: kombu binds a copy of
        # the queue to the channel to look it up in its cache, which cost a third of a publish. A broker that
        # lost its queues needs no new declaration: a publish by queue name creates the queue, and the
        # workers declare what they consume.
        declare = [] if queue in self._declared else [self._queues[queue]]
        with self._producers.acquire(block=True, timeout=ACQUIRE_TIMEOUT_S) as producer:
            producer.publish(
                job_message(job_id), exchange="", routing_key=queue, declare=declare,
                serializer="json", delivery_mode="persistent", retry=True, retry_policy=PUBLISH_RETRY,
            )
        self._declared.add(queue)

    def ping(self) -> bool:
        try:
            with self._connection.clone() as conn:
                conn.ensure_connection(max_retries=1, interval_start=0, timeout=CONNECT_TIMEOUT_S)
            return True
        except Exception as exc:
            log.debug("broker ping failed: %s", exc)
            return False

    def depth(self, queue: str) -> int:
        """Messages waiting in the broker's queue (not those delivered and unacknowledged)."""
        with self._connection.clone() as conn, conn.channel() as channel:
            declared = self._queues[queue].bind(channel).queue_declare()
            return int(declared.message_count) if declared is not None else 0

    def lost_messages(self) -> bool:
        """True, to exactly one caller, after the broker lost its queues (or is new): its epoch marker was
        missing and this call set it. Brokers that keep their queues on restart (RabbitMQ) never say so."""
        if self._redis is None:
            return False
        return bool(self._redis.set(EPOCH_KEY, uuid.uuid4().hex, nx=True))

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()
        self._producers.force_close_all()
        self._connections.force_close_all()
        self._connection.release()


def _redis_client(broker_url: str) -> redis.Redis | None:
    if not broker_url.startswith(("redis://", "rediss://")):
        return None
    return redis.Redis.from_url(broker_url, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                socket_timeout=CONNECT_TIMEOUT_S)
