"""Dispatch without loss: the store is the truth, the broker is re-filled from it.

Every worker process (and the embedded runtime) runs this loop every reconcile_interval_s:
  1. queued jobs past their ttl -> expired;
  2. running jobs of dead workers (stopped, or no heartbeat for worker_dead_after_s) -> queued (and
     undispatched), so a SIGKILLed worker's job runs again;
  3. queued jobs still undispatched after dispatch_grace_s (the API died between commit and publish, the
     broker was down, or step 2 just requeued them) are published and marked dispatched.
Every change is a conditional UPDATE, so reconcilers may run concurrently; a job published twice is claimed
once (the second message finds it no longer queued and is dropped).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy.orm import Session, sessionmaker

from api.settings import Settings
from api.store import jobs, workers
from api.store.models import utcnow
from worker.dispatch import Publish, publish_and_mark

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReconcileReport:
    expired: int
    requeued: int
    published: int


class Reconciler:
    def __init__(self, sessions: sessionmaker[Session], publish: Publish, settings: Settings) -> None:
        self._sessions = sessions
        self._publish = publish
        self._interval_s = settings.reconcile_interval_s
        self._grace = timedelta(seconds=settings.dispatch_grace_s)
        self._dead_after_s = settings.worker_dead_after_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="reconciler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def run_once(self) -> ReconcileReport:
        now = utcnow()
        with self._sessions() as session:
            expired = jobs.expire_overdue(session, now)
            dead = workers.dead_workers_with_jobs(session, now=now, dead_after_s=self._dead_after_s)
            requeued = jobs.requeue_orphans(session, dead, now)
            # Requeued jobs go out now, whatever their age; the rest once the API's grace has passed.
            stale = jobs.undispatched(session, now - self._grace)
        pending = requeued + [job for job in stale if job not in requeued]
        if requeued:
            log.warning("requeued %d job(s) of dead worker(s) %s", len(requeued), dead)
        published = publish_and_mark(self._sessions, self._publish, pending)
        if published:
            log.info("published %d undispatched job(s)", published)
        return ReconcileReport(expired=len(expired), requeued=len(requeued), published=published)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.run_once()
            except Exception:  # store briefly unreachable: try again next round
                log.exception("reconcile failed")
