"""`python -m worker`: the Celery worker with settings from CONVEYOR_* (same as `conveyor worker`)."""

from __future__ import annotations

import logging

from core.settings import load_settings
from worker.celery_worker import run_worker

if __name__ == "__main__":
    settings = load_settings()
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # request lines carry webhook URLs and tokens
    run_worker(settings)
