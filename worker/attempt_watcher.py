"""The attempt watcher: a thread that polls the store for the attempts in flight here and aborts, in the
engine, those that were cancelled, that ran past their `timeout`, or that the store no longer calls current
(the job was requeued to another attempt while this worker was paused or cut off)."""

from __future__ import annotations

import logging
import time

from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.background import BackgroundLoop
from conveyor.core.lifecycle import CANCELLED, RUNNING
from conveyor.core.store import jobs
from conveyor.engine.host import EngineHost
from conveyor.worker.attempt import CANCELLED_REASON, SUPERSEDED, TIMEOUT, Attempt
from conveyor.worker.in_flight import InFlight

log = logging.getLogger(__name__)


class AttemptWatcher:
    def __init__(self, host: EngineHost, sessions: sessionmaker[Session], worker_id: str, in_flight: InFlight,
                 *, poll_s: float) -> None:
        self._host = host
        self._sessions = sessions
        self._worker_id = worker_id
        self._in_flight = in_flight
        self._loop = BackgroundLoop.every("job-watcher", poll_s, self.check_once, on_error=_log_failed_check)

    def start(self) -> None:
        self._loop.start()

    def request_stop(self) -> None:
        """No more checks from now on (a check under way finishes)."""
        self._loop.request_stop()

    def join(self) -> None:
        self._loop.join()

    def check_once(self) -> None:
        """Aborts attempts that were cancelled in the store, were superseded (the job was requeued or taken
        by another attempt), or have run past their timeout."""
        live = [a for a in self._in_flight.snapshot() if a.abort_reason is None]
        if not live:
            return
        with self._sessions() as session:
            states = jobs.attempt_states(session, list({a.job_id for a in live}))
        now = time.monotonic()
        for attempt in live:
            state = states.get(attempt.job_id)
            if state is not None and state.status == CANCELLED:
                self.abort(attempt, CANCELLED_REASON)
            elif not self._is_current(attempt, state):
                self.abort(attempt, SUPERSEDED)
            elif attempt.timeout_s is not None and now - attempt.started > attempt.timeout_s:
                self.abort(attempt, TIMEOUT)

    def abort(self, attempt: Attempt, reason: str) -> None:
        """Aborts the attempt in the engine; its outcome (by `reason`) comes back through its future."""
        attempt.abort_reason = reason
        cancelled = [self._host.cancel(request_id) for request_id in attempt.request_ids()]
        if any(cancelled):
            log.info("job %s: aborting in the engine (%s)", attempt.job_id, reason)

    def _is_current(self, attempt: Attempt, state: jobs.AttemptState | None) -> bool:
        """Whether the store still runs this attempt here. A finished attempt whose outcome is on its way
        is still current: its row says so until the outcome write lands."""
        return (state is not None and state.status == RUNNING and state.attempts == attempt.attempt
                and state.worker_id == self._worker_id)


def _log_failed_check(_exc: Exception) -> None:
    log.exception("cancel/timeout check failed")  # the database may be briefly unreachable; next tick
