"""`conveyor worker`: one process per GPU, one engine loaded once, consuming both job queues via Celery."""

from __future__ import annotations

import logging
import socket

from core.broker import BrokerPublisher
from core.finished_jobs import RedisFinishedSink
from core.settings import Settings
from core.store.database import make_db_engine, make_session_factory
from worker.celery_app import CONTROL_QUEUE, make_celery_app
from worker.consumer import job_consumer_step
from worker.heartbeat import new_worker_id
from worker.services import WorkerServices
from worker.token_sinks import RedisTokenSink

log = logging.getLogger(__name__)


def run_worker(settings: Settings) -> None:
    """Blocks until SIGTERM/SIGINT; then stops taking jobs, finishes or requeues in-flight ones, and exits."""
    app = make_celery_app(settings)
    sessions = make_session_factory(make_db_engine(settings.database_url))
    worker_id = new_worker_id()
    publisher = BrokerPublisher(settings)
    redis_broker = settings.broker_url is not None and settings.broker_url.startswith("redis")
    tokens = RedisTokenSink(settings.broker_url or "") if redis_broker else None  # text deltas to the API
    finished = RedisFinishedSink(settings.broker_url or "") if redis_broker else None  # wakes API waiters
    services = WorkerServices(settings, sessions, publisher, worker_id, tokens=tokens,
                              republish_requeued=True, finished=finished)
    services.start()
    grace_s = settings.worker_shutdown_grace_s
    app.steps["consumer"].add(job_consumer_step(services.runner, grace_s=grace_s, publish=publisher.publish))
    try:
        worker = app.Worker(
            hostname=f"{worker_id}@{socket.gethostname()}", pool="solo", concurrency=1,
            queues=[CONTROL_QUEUE], without_mingle=True, without_gossip=True, without_heartbeat=True,
            loglevel=settings.log_level,
        )
        worker.start()
    finally:
        services.stop()  # the consumer step already shut the job runner down on SIGTERM: a no-op then
        publisher.close()
        if tokens is not None:
            tokens.close()
        if finished is not None:
            finished.close()
