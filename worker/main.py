"""`conveyor worker`: one process per GPU, one engine loaded once, consuming both job queues via Celery."""

from __future__ import annotations

import logging
import socket

from api.settings import Settings
from api.store.db import make_engine, make_session_factory
from engine.host import EngineHost
from worker.batches.runner import make_batch_runner
from worker.celery_app import CONTROL_QUEUE, make_celery_app
from worker.consumer import job_consumer_step
from worker.dispatch import CeleryPublisher
from worker.heartbeat import Heartbeat, new_worker_id
from worker.job_runner import JobRunner
from worker.model import engine_config, resolve_model
from worker.reconciler import Reconciler
from worker.token_stream import RedisTokenSink
from worker.webhooks.sender import WebhookSender

log = logging.getLogger(__name__)


def run_worker(settings: Settings) -> None:
    """Blocks until SIGTERM/SIGINT; then stops taking jobs, finishes or requeues in-flight ones, and exits."""
    app = make_celery_app(settings)
    sessions = make_session_factory(make_engine(settings.database_url))
    worker_id = new_worker_id()
    config = engine_config(settings, resolve_model(settings))
    log.info("loading engine for %s", config.model)
    host = EngineHost.from_config(config)
    publisher = CeleryPublisher(settings, app)
    redis_broker = settings.broker_url is not None and settings.broker_url.startswith("redis")
    tokens = RedisTokenSink(settings.broker_url or "") if redis_broker else None  # text deltas to the API
    runner = JobRunner(host, sessions, worker_id, cancel_poll_s=settings.cancel_poll_s, tokens=tokens)
    heartbeat = Heartbeat(sessions, worker_id, list(settings.queues), settings.worker_heartbeat_s)
    reconciler = Reconciler(sessions, publisher, settings)
    webhook_sender = WebhookSender(sessions, settings)
    batch_runner = make_batch_runner(sessions, settings, publisher.publish, worker_id, host.tokenizer)
    limits = {name: queue.max_running for name, queue in settings.queues.items()}
    app.steps["consumer"].add(
        job_consumer_step(runner, limits, grace_s=settings.worker_shutdown_grace_s, publish=publisher.publish)
    )
    heartbeat.start()
    runner.start()
    reconciler.start()
    webhook_sender.start()
    batch_runner.start()
    try:
        worker = app.Worker(
            hostname=f"{worker_id}@{socket.gethostname()}", pool="solo", concurrency=1,
            queues=[CONTROL_QUEUE], without_mingle=True, without_gossip=True, without_heartbeat=True,
            loglevel=settings.log_level,
        )
        worker.start()
    finally:
        # A no-op when the consumer step already did it (SIGTERM).
        runner.shutdown(settings.worker_shutdown_grace_s, publisher.publish)
        batch_runner.stop()
        reconciler.stop()
        webhook_sender.stop()
        heartbeat.stop()
        host.shutdown()
        publisher.close()
        if tokens is not None:
            tokens.close()
        log.info("worker %s stopped", worker_id)
