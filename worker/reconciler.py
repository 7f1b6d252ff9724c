"""Dispatch without loss: the store is the truth, the broker is re-filled from it.

Every worker process (and the embedded runtime) runs this loop every reconcile_interval_s:
  1. queued jobs past their ttl -> expired;
  2. running jobs of dead workers (stopped, or no heartbeat for worker_dead_after_s) -> queued (and
     undispatched), so a SIGKILLed worker's job runs again;
  3. queued jobs still undispatched after dispatch_grace_s (the API died between commit and publish, the
     broker was down, or step 2 just requeued them) are published and marked dispatched;
  4. a queue the broker reports empty while the store still has jobs of it queued, dispatched a while ago
     (REDISPATCH_FACTOR x dispatch_grace_s), lost their messages (Redis restarted without its append-only
     file, or a worker died between delivery and claim): they are published again.
Every change is a conditional UPDATE, so reconcilers may run concurrently; a job published twice is claimed
once (the second message finds it no longer queued and is dropped).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Protocol

from sqlalchemy.orm import Session, sessionmaker

from core.clock import utcnow
from core.dispatch import publish_and_mark
from core.settings import Settings
from core.store import jobs, workers

log = logging.getLogger(__name__)

REDISPATCH_FACTOR = 10  # a dispatched job still queued this many grace periods later, in an empty queue
REDISPATCH_BATCH = 1000


class Broker(Protocol):
    def publish(self, job_id: str, queue: str) -> None: ...

    def depth(self, queue: str) -> int: ...


@dataclass(frozen=True)
class ReconcileReport:
    expired: int
    requeued: int
    published: int
    redispatched: int = 0


class Reconciler:
    def __init__(self, sessions: sessionmaker[Session], broker: Broker, settings: Settings) -> None:
        self._sessions = sessions
        self._broker = broker
        self._queues = list(settings.queues)
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
            stale = jobs.undispatched(session, now - self._grace)
        if requeued:
            log.warning("requeued %d job(s) of dead worker(s) %s", len(requeued), dead)
        # Requeued jobs go out now, whatever their age; the rest once the API's grace has passed.
        pending = requeued + [job for job in stale if job not in requeued]
        published = publish_and_mark(self._sessions, self._broker.publish, pending)
        if published:
            log.info("published %d undispatched job(s)", published)
        redispatched = 0
        if published == len(pending):  # the broker is up
            redispatched = self._redispatch_lost(now - REDISPATCH_FACTOR * self._grace)
        return ReconcileReport(expired=len(expired), requeued=len(requeued), published=published,
                               redispatched=redispatched)

    def _redispatch_lost(self, dispatched_before: datetime) -> int:
        total = 0
        for queue in self._queues:
            with self._sessions() as session:
                lost = jobs.dispatched_but_queued(session, queue, dispatched_before, REDISPATCH_BATCH)
            if not lost or self._broker.depth(queue) > 0:
                continue
            log.warning("queue %s is empty in the broker but %d job(s) of it are queued: publishing again",
                        queue, len(lost))
            total += publish_and_mark(self._sessions, self._broker.publish, lost)
        return total

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.run_once()
            except Exception:  # store or broker briefly unreachable: try again next round
                log.exception("reconcile failed")
