"""The outcome writer: one thread that stores what each engine step produced (first tokens, outcomes) in one
transaction (jobs.record_step), each row still behind its own conditional UPDATE.

Per-job transactions, not the engine, are what limit short jobs, hence the groups. When the writer falls
behind, the next group simply holds several steps. A group is kept and retried until the store takes it (a
database outage only delays it); its attempts stay in flight meanwhile, holding their places in their
queues' room, which bounds what waits. Once a group is written, each of its ended attempts is released
(the runner's callback: out of flight, its stream ended, its caller told).
"""

from __future__ import annotations

import logging
import queue as stdlib_queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.exc import OperationalError
from tenacity import Retrying, retry_if_exception_type, wait_exponential

from conveyor.core.background import BackgroundLoop
from conveyor.core.clock import utcnow
from conveyor.core.retry_policy import Backoff
from conveyor.core.seams.finish_notifications import FinishedSink
from conveyor.core.store import jobs
from conveyor.core.store.held_sessions import SessionFactory
from conveyor.engine.tokenizer import Tokenizer
from conveyor.worker.attempt import ENGINE_ERROR, Attempt, EngineFuture
from conveyor.worker.attempt_outcome import Ended, describe, outcome

log = logging.getLogger(__name__)

STORE_RETRY_FIRST_WAIT_S = 0.2  # first pause between outcome writes while the database is unreachable,
STORE_RETRY_MAX_WAIT_S = 5.0  # doubling up to this
GROUP_LINGER_S = 0.005  # how long the writer waits for the rest of a step before writing what it has
MAX_GROUP = 512  # writes per transaction

Release = Callable[[Attempt], None]  # after an ended attempt's outcome is written (or given up on)


@dataclass(frozen=True)
class _FirstToken:
    attempt: Attempt
    at: datetime


_STEP_END = "step end"  # in the inbox: the engine step's outputs are all in
_STOP = "stop"
_Item = _FirstToken | Ended | str


class OutcomeWriter:
    def __init__(self, sessions: SessionFactory, tokenizer: Tokenizer, release: Release, *,
                 finished: FinishedSink | None = None, backoff: Backoff = Backoff()) -> None:
        """`finished` is told which jobs each group made final (long polls wake); `backoff`: the wait before
        a retryable failure's next attempt (core/retry_policy.py)."""
        self._sessions = sessions
        self._backoff = backoff
        self._tokenizer = tokenizer  # decodes logprobs' tokens
        self._release = release
        self._finished = finished
        self._inbox: stdlib_queue.SimpleQueue[_Item] = stdlib_queue.SimpleQueue()
        self._step_had_news = False  # the current engine step queued something
        self._abandon = threading.Event()  # shutdown's last resort: unwritten outcomes are dropped
        self._loop = BackgroundLoop("job-writer", lambda _stop: self._write_loop(),
                                    wake=lambda: self._inbox.put(_STOP))

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        """Writes what is already queued (unless abandoned), then stops."""
        self._loop.stop()

    def abandon(self) -> None:
        """Writes still waiting on the store give up (at a shutdown that cannot wait any longer)."""
        self._abandon.set()

    # --- engine thread -----------------------------------------------------------------------------------

    def first_token(self, attempt: Attempt, at: datetime) -> None:
        self._from_step(_FirstToken(attempt, at))

    def ended(self, attempt: Attempt, future: EngineFuture) -> None:
        self._from_step(Ended(attempt, future))

    def step_ended(self) -> None:
        """The engine's step listener: what this step queued is all in."""
        if self._step_had_news:
            self._step_had_news = False
            self._inbox.put(_STEP_END)

    def _from_step(self, item: _FirstToken | Ended) -> None:
        self._step_had_news = True
        self._inbox.put(item)

    # --- any thread --------------------------------------------------------------------------------------

    def refused(self, attempt: Attempt, code: str, message: str) -> None:
        """An attempt the engine refused at submit (outside any step)."""
        self._inbox.put(Ended(attempt, failure=(code, message)))

    # --- writer thread -----------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        stopping = False
        while not stopping:
            group, stopping = self._next_group(self._inbox.get())
            if group:
                self._write_group(group)

    def _next_group(self, first: _Item) -> tuple[list[_FirstToken | Ended], bool]:
        """`first` and what follows it of the same engine step (and any later ones already waiting).
        Returns (group, whether the stop marker was seen)."""
        group: list[_FirstToken | Ended] = []
        step_over, item = False, first
        while True:
            if item is _STOP:
                return group, True
            if item is _STEP_END:
                step_over = True
            else:
                assert isinstance(item, _FirstToken | Ended)
                group.append(item)
            if len(group) >= MAX_GROUP:
                return group, False
            try:  # once the step is over, only what is already here; before, a moment for the rest of it
                item = self._inbox.get(block=not step_over, timeout=None if step_over else GROUP_LINGER_S)
            except stdlib_queue.Empty:
                return group, False

    def _write_group(self, group: list[_FirstToken | Ended]) -> None:
        ended = [item for item in group if isinstance(item, Ended)]
        ending = {item.attempt.request_id for item in ended}
        first_tokens = [jobs.FirstToken(item.attempt.job_id, item.attempt.attempt, item.at) for item in group
                        if isinstance(item, _FirstToken) and item.attempt.request_id not in ending]
        outcomes = [written for item in ended if (written := outcome(item, self._tokenizer)) is not None]
        try:
            finished = self._write(first_tokens, outcomes)
        except OperationalError as exc:  # only at a shutdown that cannot wait for the store any longer
            log.error("shutdown: %d outcome(s) not stored (%s); the jobs stay running under this worker, "
                      "and another worker's reconciler requeues them", len(outcomes), describe(exc))
            finished = []
        except Exception:  # not the database being away: one of the writes itself
            log.exception("a group of %d write(s) failed; writing them one by one", len(outcomes))
            finished = self._write_each(outcomes)
        if finished and self._finished is not None:
            self._finished.finished(finished)
        for item in ended:
            self._release(item.attempt)

    def _write_each(self, outcomes: list[jobs.Outcome]) -> list[str]:
        """The outcomes of a group that failed, each in its own transaction: a result the store cannot take
        becomes a failure of that job alone."""
        finished = []
        for written in outcomes:
            try:
                finished += self._write([], [written])
            except Exception as exc:
                log.exception("job %s: could not store its outcome", written.job_id)
                if isinstance(written, jobs.Completion):
                    failure = jobs.Failure(written.job_id, written.attempt, ENGINE_ERROR,
                                           f"could not store the result: {type(exc).__name__}")
                    finished += self._write_failure(failure)
        return finished

    def _write_failure(self, failure: jobs.Failure) -> list[str]:
        try:
            return self._write([], [failure])
        except Exception:
            log.exception("job %s: could not store its failure (%s)", failure.job_id, failure.code)
            return []

    def _write(self, first_tokens: list[jobs.FirstToken], outcomes: list[jobs.Outcome]) -> list[str]:
        """jobs.record_step in its own session, retried for as long as the database is unreachable (its
        transitions are conditional UPDATEs, so a retry after a commit whose answer was lost is a no-op).
        Only a shutdown that cannot wait any longer gives up (OperationalError); the jobs then stay
        `running` under this worker, whose heartbeat stops, and another worker's reconciler requeues them."""
        now = utcnow()
        backoff = wait_exponential(multiplier=STORE_RETRY_FIRST_WAIT_S, max=STORE_RETRY_MAX_WAIT_S)
        retrying = Retrying(retry=retry_if_exception_type(OperationalError),
                            stop=lambda _: self._abandon.is_set(), wait=backoff,
                            before_sleep=_log_store_retry, reraise=True)
        for attempt in retrying:
            with attempt, self._sessions() as session:
                return jobs.record_step(session, first_tokens, outcomes, now, self._backoff)
        raise AssertionError("unreachable: Retrying either returns or raises")


def _log_store_retry(state: Any) -> None:
    exc = state.outcome.exception() if state.outcome is not None else None
    log.warning("store unreachable (%s); outcome write retry %d", describe(exc) if exc else "?",
                state.attempt_number)
