"""The worker's Celery app, on the broker settings of core/seams/broker.py (which the API publishes with).

Job queues are consumed by conveyor.worker.consumer.JobConsumerStep (one channel per queue); Celery's own task
consumer only listens on a control queue kept for service tasks.
"""

from __future__ import annotations

from celery import Celery

from conveyor.core.seams.broker import CONNECT_TIMEOUT_S, POOL_LIMIT, TRANSPORT_OPTIONS
from conveyor.core.settings import Settings

CONTROL_QUEUE = "conveyor.control"


def make_celery_app(settings: Settings) -> Celery:
    if settings.broker_url is None:
        raise ValueError("broker_url: a Celery app needs a broker (unset means embedded mode)")
    app = Celery("conveyor", broker=settings.broker_url, set_as_current=False)
    app.conf.update(
        task_default_queue=CONTROL_QUEUE,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        broker_connection_retry_on_startup=True,
        # Only Celery tasks are cancelled on connection loss; engine jobs run on (see worker/consumer.py).
        worker_cancel_long_running_tasks_on_connection_loss=True,
        broker_connection_timeout=CONNECT_TIMEOUT_S,
        broker_pool_limit=POOL_LIMIT,
        broker_transport_options=dict(TRANSPORT_OPTIONS),
        result_backend=None,
    )
    return app
