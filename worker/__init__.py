"""Everything that runs next to an engine: one engine per process, fed from the store through a broker
(Celery on Redis) or in-process queues (worker/services.py wires it all)."""
