"""A worker's presence in the store: registered at start, a heartbeat every few seconds, stopped at exit."""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable

from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.background import BackgroundLoop
from conveyor.core.clock import utcnow
from conveyor.core.store import workers

log = logging.getLogger(__name__)


def new_worker_id(kind: str = "worker") -> str:
    return f"{kind}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


Pace = dict[str, float]  # engine/pace.py Pace.to_json()


class Heartbeat:
    def __init__(
        self, sessions: sessionmaker[Session], worker_id: str, queues: list[str], interval_s: float,
        pace: Callable[[], Pace | None] = lambda: None,
    ) -> None:
        """`pace`: the engine's current pace and load (WorkerServices._engine_pace; None before the engine is
        loaded), published with every beat."""
        self.worker_id = worker_id
        self._sessions = sessions
        self._queues = queues
        self._pace = pace
        self._loop = BackgroundLoop.every("worker-heartbeat", interval_s, self._beat,
                                          on_error=_log_failed_beat)
        self._last_beat = time.monotonic()  # of the last beat the store took (registration included)

    def age_s(self) -> float:
        """Seconds since the store last took this worker's beat (its metrics report it: a worker that cannot
        reach the store looks dead to the reconcilers long before it looks dead to anything else)."""
        return time.monotonic() - self._last_beat

    def start(self) -> None:
        with self._sessions() as session:
            workers.register(session, self.worker_id, hostname=socket.gethostname(), pid=os.getpid(),
                             queues=self._queues, now=utcnow())
        self._last_beat = time.monotonic()
        self._loop.start()
        log.info("worker %s registered for queues %s", self.worker_id, self._queues)

    def stop(self) -> None:
        self._loop.stop()
        with self._sessions() as session:
            workers.mark_stopped(session, self.worker_id, utcnow())

    def _beat(self) -> None:
        with self._sessions() as session:
            if not workers.heartbeat(session, self.worker_id, utcnow(), self._pace()):
                log.error("worker %s is not registered as running in the store", self.worker_id)
            else:
                self._last_beat = time.monotonic()


def _log_failed_beat(_exc: Exception) -> None:
    log.exception("heartbeat failed")  # the store may be briefly down; the next beat retries
