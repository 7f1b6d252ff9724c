"""`conveyor worker`: one process per GPU, one model's engine loaded once, consuming its queues via Celery.

Celery's banner is off: it lists only the control queue and an empty task list, because the job queues are
consumed by worker/consumer.py's bootstep. The worker logs its own summary instead, once it consumes.
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
from typing import Any

from celery import signals
from celery.exceptions import SecurityWarning

import conveyor.engine.model_runner  # noqa: F401  (imported with the rest: "imports" in the cold-start figures)
from conveyor.core.log_setup import masked_url
from conveyor.core.seams.broker import BrokerPublisher
from conveyor.core.seams.finish_notifications import RedisFinishedSink
from conveyor.core.settings import Settings
from conveyor.core.store.database import make_db_engine, make_session_factory
from conveyor.engine.host import EngineHost
from conveyor.worker.celery_app import CONTROL_QUEUE, make_celery_app
from conveyor.worker.cold_start import ColdStart
from conveyor.worker.consumer import JobConsumerStep, JobFeed, worker_options
from conveyor.worker.engine_metrics import by_model
from conveyor.worker.heartbeat import new_worker_id
from conveyor.worker.metrics_server import serve_metrics
from conveyor.worker.model import describe_engine
from conveyor.worker.services import WorkerServices
from conveyor.worker.token_sinks import RedisTokenSink

log = logging.getLogger(__name__)


def run_worker(settings: Settings, *, banner: bool = False, cold_start: ColdStart | None = None) -> None:
    """Blocks until SIGTERM/SIGINT; then stops taking jobs, finishes or requeues in-flight ones, and exits.
    `banner`: Celery's own start-up banner too (conveyor --debug). `cold_start`: made by the caller when its
    imports were done (else now: this module's imports, torch, the engine and Celery, are done)."""
    cold_start = cold_start if cold_start is not None else ColdStart()
    settings = settings.for_model(settings.worker_model_id())  # the one model this worker serves
    app = make_celery_app(settings)
    worker_id = new_worker_id()
    sessions = make_session_factory(make_db_engine(settings.database_url, session_name=worker_id))
    publisher = BrokerPublisher(settings)
    redis_broker = settings.broker_url is not None and settings.broker_url.startswith("redis")
    tokens = RedisTokenSink(settings.broker_url or "") if redis_broker else None  # text deltas to the API
    finished = RedisFinishedSink(settings.broker_url or "") if redis_broker else None  # wakes API waiters
    services = WorkerServices(settings, sessions, publisher, worker_id, tokens=tokens,
                              republish_requeued=True, finished=finished)
    services.start()
    services.metrics.track_cold_start(cold_start)
    stop_metrics = serve_metrics(settings, by_model({services.model_id: services.metrics.registry}))
    cold_start.engine_ready(services.host)
    cold_start.watch_first_token(services.host)
    feed = JobFeed(services.runner, grace_s=settings.worker_shutdown_grace_s, publish=publisher.publish)
    app.steps["consumer"].add(JobConsumerStep)
    _replace_root_warning()
    summary = _summary_on_ready(settings, services.host, worker_id)
    try:
        worker = app.Worker(
            hostname=f"{worker_id}@{socket.gethostname()}", pool="solo", concurrency=1,
            queues=[CONTROL_QUEUE], without_mingle=True, without_gossip=True, without_heartbeat=True,
            loglevel=settings.log_level, quiet=not banner, **worker_options(feed),
        )
        worker.start()
    finally:
        signals.worker_ready.disconnect(summary)
        services.stop()  # the consumer step already shut the job runner down on SIGTERM: a no-op then
        stop_metrics()
        publisher.close()
        if tokens is not None:
            tokens.close()
        if finished is not None:
            finished.close()


def startup_summary(settings: Settings, host: EngineHost, worker_id: str) -> list[str]:
    """What an operator checks first: which queues with which limits, which model on what, where it talks."""
    queues = ", ".join(f"{name} (max_running {q.max_running}, priority {q.priority})"
                       for name, q in settings.consumed_queues().items())
    return [
        f"worker {worker_id} serves model {settings.served_model_id()}, consuming: {queues}",
        f"engine: {describe_engine(host, settings.model_source())}",
        f"broker {masked_url(settings.broker_url or '')}; database {masked_url(settings.database_url)}",
    ]


def _summary_on_ready(settings: Settings, host: EngineHost, worker_id: str) -> Any:
    """Logs the summary when Celery's consumer is up (connected, job queues consumed): then it is true."""

    def on_ready(**_: Any) -> None:
        for line in startup_summary(settings, host, worker_id):
            log.info("%s", line)

    signals.worker_ready.connect(on_ready, weak=False)
    return on_ready


def _replace_root_warning() -> None:
    """Celery's multi-line SecurityWarning about root becomes one line. Its risk, unpickling messages as
    root, does not apply (the worker accepts JSON only); running as root still deserves a line, since a
    container should not (the image runs as an unprivileged user)."""
    warnings.filterwarnings("ignore", category=SecurityWarning)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        log.warning("running as root: fine on a development machine; in production run workers as an "
                    "unprivileged user")
