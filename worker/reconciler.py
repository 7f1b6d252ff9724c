"""Dispatch without loss: the store is the truth, the broker is re-filled from it.

Every worker process (and the embedded runtime) runs this loop every reconcile_interval_s:
  1. queued jobs past their ttl -> expired;
  2. running jobs of dead workers (stopped, or no heartbeat for worker_dead_after_s) -> queued (and
     undispatched), so a SIGKILLed worker's job runs again; one that has had its max_attempts runs ->
     failed (`worker_lost`) instead. A worker never judges itself: its own heartbeat may be late (the
     database was down, the process was paused) while it is plainly alive;
  3. this worker's own running jobs that its runner does not hold (the claim committed but its answer was
     lost with the connection) -> queued; and queued jobs under a bare queue name (an API of the release
     before lanes still ran during the upgrade, migration 0017) -> the default model's lane of that name;
  4. queued jobs still undispatched after dispatch_grace_s (the API died between commit and publish, the
     broker was down, or steps 2-3 just requeued them) are published and marked dispatched;
  5. lost messages are published again, oldest first:
     - after the broker lost its queues (Redis restarted without its data; `lost_messages()` says so once,
       to one reconciler in the fleet), every queued job dispatched before then, however busy the queue is.
       That reconciler records a walk in the store (core/store/republish_walk.py); every reconciler then
       takes part, one at a time, a batch of REDISPATCH_BATCH jobs per transaction from a cursor kept in one
       row, and at most REPUBLISH_ROUND_S of them per round (the other rules wait for none of it). No job
       row is written: a walk of 100,000 jobs is 100 index range reads and 100 one-row updates. A walker
       that dies leaves the walk to the others, from its cursor;
     - a queue the broker reports empty while the store still has jobs of it queued, dispatched a while
       ago (REDISPATCH_FACTOR x dispatch_grace_s): their messages went missing some other way (each is
       marked dispatched again, so the next round moves on).
Every purge_interval_s it also runs the retention purge (core/store/retention.py) and prunes the rows of
long-dead workers.
Every change is a conditional UPDATE, so reconcilers may run concurrently; a job published twice is claimed
once (the second message finds it no longer queued and is dropped).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Protocol

from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.background import BackgroundLoop
from conveyor.core.clock import utcnow
from conveyor.core.seams.dispatch import publish_and_mark, publish_in_order
from conveyor.core.seams.finish_notifications import FinishedSink
from conveyor.core.settings import Settings
from conveyor.core.store import job_tallies, jobs, republish_walk, retention, workers

log = logging.getLogger(__name__)

REDISPATCH_FACTOR = 10  # a dispatched job still queued this many grace periods later, in an empty queue
REDISPATCH_BATCH = 1000  # jobs read and published per transaction of a republish
REPUBLISH_ROUND_S = 5.0  # a round's republish after a broker restart stops after the batch that passes it

HeldAttempts = Callable[[], set[tuple[str, int]]]  # (job id, attempt) this worker's runner holds
ClaimsSince = Callable[[], datetime | None]  # when the oldest claim on its way to the runner began


Stopping = Callable[[], bool]  # whether this worker's runner is shutting down


def _no_claims() -> datetime | None:
    return None


def _never() -> bool:
    return False


class Broker(Protocol):
    def publish(self, job_id: str, queue: str) -> None: ...

    def depth(self, queue: str) -> int: ...

    def lost_messages(self) -> bool: ...


@dataclass(frozen=True)
class Local:
    """The worker this reconciler runs in: never declared dead by itself, and the judge of its own claims."""

    worker_id: str
    held: HeldAttempts
    claims_since: ClaimsSince = _no_claims
    stopping: Stopping = _never


@dataclass(frozen=True)
class ReconcileReport:
    expired: int
    requeued: int
    published: int
    redispatched: int = 0
    lost: int = 0  # failed with worker_lost: their worker died on each of their max_attempts runs


class Reconciler:
    def __init__(self, sessions: sessionmaker[Session], broker: Broker, settings: Settings,
                 local: Local | None = None, finished: FinishedSink | None = None) -> None:
        self._sessions = sessions
        self._finished = finished
        self._broker = broker
        self._local = local
        self._queues = settings.lanes()  # every model's: a fleet-wide duty
        self._default_model = settings.default_model_id()
        self._queue_names = sorted({name for served in settings.served().values() for name in served.queues})
        self._interval_s = settings.reconcile_interval_s
        self._grace = timedelta(seconds=settings.dispatch_grace_s)
        self._dead_after_s = settings.worker_dead_after_s
        self._settings = settings
        self._next_purge = time.monotonic()  # the first round purges; then every purge_interval_s
        self._lost_at: datetime | None = None  # the broker lost its queues then; no walk in the store yet
        self._loop = BackgroundLoop.every("reconciler", self._interval_s, self._round, on_error=self._failed)

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()

    def run_once(self) -> ReconcileReport:
        now = utcnow()
        with self._sessions() as session:
            expired = jobs.expire_overdue(session, now)
            dead = workers.dead_workers_with_jobs(session, now=now, dead_after_s=self._dead_after_s)
            if self._local is not None and self._local.worker_id in dead:
                dead.remove(self._local.worker_id)
            ended = workers.end_idle_transactions(session, dead)
            if ended:
                log.warning("ended %d idle transaction(s) of dead worker(s) %s: their row locks kept their "
                            "jobs from being requeued", ended, dead)
            lost = jobs.fail_lost(session, dead, now, self._settings.max_attempts)
            if lost:
                log.warning("failed %d job(s) as worker_lost: their worker died and they had had their "
                            "max_attempts (%d) runs", len(lost), self._settings.max_attempts)
            requeued = jobs.requeue_orphans(session, dead, now)
            if requeued:
                log.warning("requeued %d job(s) of dead worker(s) %s", len(requeued), dead)
            requeued += self._requeue_unheld(session, now)
            requeued += self._adopt_bare_queued(session, now)
            stale = jobs.undispatched(session, now - self._grace)
            job_tallies.fold(session)
        if (expired or lost) and self._finished is not None:
            self._finished.finished(expired + lost)
        # Requeued jobs go out now, whatever their age; the rest once the API's grace has passed.
        pending = requeued + [job for job in stale if job not in requeued]
        published = publish_and_mark(self._sessions, self._broker.publish, pending)
        if published:
            log.info("published %d undispatched job(s)", published)
        redispatched = 0
        if published == len(pending):  # the broker is up
            redispatched = self._redispatch_lost(now)
        return ReconcileReport(expired=len(expired), requeued=len(requeued), published=published,
                               redispatched=redispatched, lost=len(lost))

    def purge_once(self) -> retention.PurgeReport:
        """The retention purge, and the rows of workers dead for worker_prune_after_s."""
        now = utcnow()
        with self._sessions() as session:
            pruned = workers.prune(session, now=now, older_than_s=self._settings.worker_prune_after_s)
        if pruned:
            log.info("pruned %d row(s) of long-dead workers", pruned)
        return retention.purge(self._sessions, self._settings, now)

    def _purge_when_due(self) -> None:
        if time.monotonic() < self._next_purge:
            return
        self._next_purge = time.monotonic() + self._settings.purge_interval_s
        self.purge_once()

    def _adopt_bare_queued(self, session: Session, now: datetime) -> list[tuple[str, str]]:
        adopted = jobs.adopt_bare_queued(session, self._default_model, self._queue_names, now)
        if adopted:
            log.warning("moved %d job(s) queued by a release before lanes to the %s model's queues",
                        len(adopted), self._default_model)
        return adopted

    def _requeue_unheld(self, session: Session, now: datetime) -> list[tuple[str, str]]:
        if self._local is None:
            return []
        # The claims on their way first, then what is held: a claim that ends between the two reads is held by
        # then, and one that begins after them is younger than `now`. A job claimed by a claim on its way is
        # left alone however long that claim takes (a stalled process, a slow store).
        on_the_way = self._local.claims_since()
        held = self._local.held()
        # A runner shutting down aborts its attempts (they leave `held`) and then requeues its own jobs,
        # counting the attempts that ran; taken here in between, each would be given back as never run.
        # Asked after the read: a read made before shutdown began holds every attempt then in flight.
        if self._local.stopping():
            return []
        started_before = now - self._grace
        if on_the_way is not None:
            started_before = min(started_before, on_the_way)
        unheld = jobs.requeue_unheld(session, self._local.worker_id, held, started_before, now)
        if unheld:
            log.warning("requeued %d job(s) claimed by this worker but never started here", len(unheld))
        return unheld

    def _redispatch_lost(self, now: datetime) -> int:
        if self._broker.lost_messages():  # said once: kept here until the store has the walk
            self._lost_at = utcnow()  # after the answer: whatever the broker lost was published before it
        if self._lost_at is not None:
            with self._sessions() as session:
                generation = republish_walk.begin(session, self._lost_at, self._queues)
            log.warning("the broker lost its queues (walk %d): publishing every queued job dispatched before "
                        "%s again", generation, self._lost_at.isoformat())
            self._lost_at = None
        republished = self._republish(time.monotonic() + REPUBLISH_ROUND_S)
        if republished is not None:
            return republished
        return self._redispatch_in_empty_queues(now - REDISPATCH_FACTOR * self._grace)

    def _republish(self, stop_at: float) -> int | None:
        """Walks the broker restart's republish on, a batch per transaction, until it ends, the broker fails
        or `stop_at` (time.monotonic()) has passed; returns how many jobs went out. None: no walk is under
        way, or another reconciler holds it now."""
        total = 0
        while True:
            with self._sessions() as session:
                walk = republish_walk.take(session)
                if walk is None:
                    return total or None
                sent, complete, walk_now = self._republish_batch(session, walk)
            total += sent
            if not complete:
                log.warning("the broker lost its queues: %d job(s) published again so far",
                            walk.published + sent)
                return total
            if walk_now is None:
                log.warning("the broker lost its queues: %d queued job(s) published again, all of them",
                            walk.published + sent)
                return total
            if sent and time.monotonic() >= stop_at:  # a lane found empty costs one index probe: go on
                return total

    def _republish_batch(self, session: Session, walk: republish_walk.Walk,
                         ) -> tuple[int, bool, republish_walk.Walk | None]:
        """One batch of the walk, in the transaction that holds its row: (jobs published, whether all of the
        batch went out, the walk as it now stands: None once it ended). A lane this release does not serve
        is passed over: there is nowhere to publish its jobs."""
        served = walk.lane in self._queues
        batch = republish_walk.next_batch(session, walk, REDISPATCH_BATCH) if served else []
        sent = publish_in_order(self._broker.publish, [(lost.job_id, walk.lane) for lost in batch])
        lane_done = sent == len(batch) < REDISPATCH_BATCH
        walk_now = republish_walk.advance(session, walk, batch[:sent], lane_done, self._queues)
        return sent, sent == len(batch), walk_now

    def _redispatch_in_empty_queues(self, dispatched_before: datetime) -> int:
        total = 0
        for queue in self._queues:
            if self._broker.depth(queue) > 0:  # the broker's count first: one round trip, no store read
                continue
            with self._sessions() as session:
                lost = jobs.dispatched_but_queued(session, queue, dispatched_before, REDISPATCH_BATCH)
            if not lost:
                continue
            log.warning("queue %s is empty in the broker but %d job(s) of it are queued: publishing again",
                        queue, len(lost))
            total += publish_and_mark(self._sessions, self._broker.publish, lost)
        return total

    def _round(self) -> None:
        self.run_once()
        self._purge_when_due()

    def _failed(self, exc: Exception) -> None:
        """Store or broker briefly unreachable: one line a round, not a traceback."""
        log.warning("reconcile failed (%s: %s); trying again in %s s", type(exc).__name__, exc,
                    self._interval_s)
        log.debug("reconcile failure", exc_info=True)
