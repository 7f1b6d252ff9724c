"""The worker: one engine per process, fed from the store through a broker (Celery on Redis) or in-process."""
