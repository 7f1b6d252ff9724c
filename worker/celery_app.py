"""The Celery app: broker connection settings shared by the worker and the API's publisher.

Job queues are consumed by worker.consumer.JobConsumerStep (one channel per queue); Celery's own task
consumer only listens on a control queue kept for service tasks.
"""

from __future__ import annotations

from celery import Celery

from api.settings import Settings

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
        broker_connection_timeout=2.0,
        broker_pool_limit=8,
        # A message held by a worker that died is restored after this long; the reconciler requeues the job
        # much sooner (worker_dead_after_s), and the late duplicate is dropped at claim.
        broker_transport_options={"visibility_timeout": 3600},
        result_backend=None,
    )
    return app
