"""Handing jobs to the broker: the publisher seam, and publishing with the store kept in step.

Dispatch scheme: "reconciler". Whoever creates a job (the API's submit, a batch runner) commits it, then
publishes its id and marks it dispatched. If publishing fails (or the process dies in between) the job stays
queued with dispatched_at NULL, and a worker's reconciler re-publishes it after `dispatch_grace_s`. Duplicate
messages are harmless: claiming a job is a conditional UPDATE. Messages carry only the job id; the store is
the source of truth. Publishers (core/broker.py for Redis, worker/in_process_queue.py when embedded) are
passed in, so the API never imports the worker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from sqlalchemy.orm import Session, sessionmaker

from core.clock import utcnow
from core.store import jobs

log = logging.getLogger(__name__)

Publish = Callable[[str, str], None]  # (job_id, queue)


class JobPublisher(Protocol):
    def publish(self, job_id: str, queue: str) -> None:
        """Hands a job id to the broker's queue; may raise (the reconciler retries later)."""

    def ping(self) -> bool:
        """Whether the broker is reachable now."""


def publish_and_mark(
    sessions: sessionmaker[Session], publish: Publish, pending: list[tuple[str, str]]
) -> int:
    """Publishes (job_id, queue) pairs in order and marks the published ones dispatched. Stops at the first
    failure (the broker is likely down): the rest stay undispatched for the next reconcile. Returns how
    many went out."""
    sent: list[str] = []
    for job_id, queue in pending:
        try:
            publish(job_id, queue)
        except Exception as exc:
            log.warning("publish of %s to %s failed (%s: %s); the reconciler will retry",
                        job_id, queue, type(exc).__name__, exc)
            break
        sent.append(job_id)
    if sent:
        with sessions() as session:
            jobs.mark_dispatched(session, sent, utcnow())
    return len(sent)
