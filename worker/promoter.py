"""Scheduled jobs become queued when due: each worker process (and the embedded runtime) polls for them
every schedule_poll_s, earlier when the next one is due sooner.

A round promotes every job due by now, earliest due first (core/store/jobs/scheduling.py promote_due: one
conditional UPDATE per chunk, rows other schedulers hold skipped), then publishes them in that order.
Promotion commits before publishing: a process that dies between the two leaves its jobs queued and
undispatched, and any reconciler publishes them after dispatch_grace_s, so no job is lost and none starts
early (the promotion itself is conditional on `run_at <= now`). Jobs due while every worker was down are
promoted together, in due order, by the first worker back.
"""

from __future__ import annotations

import logging
import threading

from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.background import BackgroundLoop
from conveyor.core.clock import utcnow
from conveyor.core.seams.dispatch import Publish, publish_and_mark
from conveyor.core.store import jobs

log = logging.getLogger(__name__)

MIN_WAIT_S = 0.05  # the shortest sleep between rounds, however soon the next job is due


class Promoter:
    def __init__(self, sessions: sessionmaker[Session], publish: Publish, poll_s: float) -> None:
        self._sessions = sessions
        self._publish = publish
        self._poll_s = poll_s
        self._loop = BackgroundLoop("scheduler", self._run)

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()

    def run_once(self) -> int:
        """Promotes and publishes the jobs due now; returns how many were published."""
        with self._sessions() as session:
            due = jobs.promote_due(session, utcnow())
        if not due:
            return 0
        published = publish_and_mark(self._sessions, self._publish, due)
        log.info("%d scheduled job(s) due: %d published", len(due), published)
        return published

    def _wait_s(self) -> float:
        """Until the next job is due, at most poll_s (a job scheduled meanwhile, by another process, waits
        at most that long)."""
        with self._sessions() as session:
            next_due = jobs.next_due(session)
        if next_due is None:
            return self._poll_s
        return min(self._poll_s, max(MIN_WAIT_S, (next_due - utcnow()).total_seconds()))

    def _run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            wait_s = self._poll_s
            try:
                self.run_once()
                wait_s = self._wait_s()
            except Exception as exc:  # the store or the broker is down: try again next round
                log.warning("scheduler round failed (%s: %s); trying again in %s s", type(exc).__name__, exc,
                            self._poll_s)
            stop.wait(wait_s)
