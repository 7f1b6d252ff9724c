"""`python -m conveyor.worker`: the Celery worker with settings from CONVEYOR_* (same as `conveyor
worker`)."""

from __future__ import annotations

from conveyor.core.log_setup import configure_logging
from conveyor.core.settings import load_settings
from conveyor.worker.celery_worker import run_worker

if __name__ == "__main__":
    settings = load_settings()
    configure_logging(settings)
    run_worker(settings)
