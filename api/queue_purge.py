"""Purging a queue (POST /v1/queues/{name}/purge, and the console's purge): its scheduled and queued jobs
cancelled in chunks of PURGE_CHUNK, each chunk committed with its effects, as if cancelled one by one."""

from __future__ import annotations

from sqlalchemy.orm import Session

from conveyor.api.deps import Services
from conveyor.core.clock import utcnow
from conveyor.core.store import jobs

PURGE_CHUNK = 500  # jobs cancelled per transaction: row locks held briefly, webhooks in step


def purge(session: Session, services: Services, lanes: list[str], tenant: str | None) -> int:
    """Cancels the waiting jobs of `lanes` of `tenant` (None: every tenant's); returns how many."""
    cancelled = 0
    while True:
        ids = jobs.cancel_queued(session, lanes, tenant, utcnow(), PURGE_CHUNK)
        if ids and services.finished is not None:  # wake their waiters here and in other API processes
            services.finished.finished(ids)
        cancelled += len(ids)
        if len(ids) < PURGE_CHUNK:
            return cancelled
