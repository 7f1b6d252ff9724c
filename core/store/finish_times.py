"""How long a new job of a queue will run and when it would finish, from what the fleet measured.

- Its run time, from the pace its queue's live workers publish with their heartbeats (engine/pace.py via
  core/store/workers.py; the median worker's): its prompt at seconds per prompt token, then up to max_tokens
  output tokens at seconds per step (a request writes one token per step; its n choices run side by side).
  Its latest start, `start_by`, is its deadline minus that: fleet claims order by it, so a long job due in a
  minute goes before a short one due in 50 seconds.
- Its wait, from the output tokens the queue delivered over the last RATE_WINDOW (its rate at the current
  load) and the output still ahead of the new job (every queued and running job of the queue may write up to
  n x max_tokens: an upper bound, so the prediction errs late, and a job asking to be refused when it cannot
  make its deadline is refused early rather than accepted and missed).

No rate (nothing finished in the window, or the queue idle): no finish prediction. No pace (no live worker
measured one yet): no run time, and the latest start is the deadline itself.

The work ahead is read from the queue's job tallies (core/store/job_tallies.py), not summed over its
backlog; a process still reuses its read of a queue's rate for up to RATE_REFRESH_S (`QueueRates`), adding
the jobs it admitted meanwhile: a burst of submits with deadlines reads the rate once a second, not once
per job.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from conveyor.core.lifecycle import SUCCEEDED
from conveyor.core.store import job_tallies, workers
from conveyor.core.store.jobs.transitions import status_is
from conveyor.core.store.tables import Job

RATE_WINDOW = timedelta(minutes=5)
RATE_REFRESH_S = 1.0  # how long a process reuses its read of a queue's rate and work ahead (QueueRates)


@dataclass(frozen=True)
class QueueRate:
    tokens_per_s: float  # output tokens the queue delivered per second over the window
    tokens_ahead: int  # upper bound of the output its queued and running jobs may still write

    def wait_s(self) -> float:
        """Seconds until everything ahead of a new job is written."""
        return self.tokens_ahead / self.tokens_per_s

    def finish_at(self, now: datetime, own_tokens: int) -> datetime:
        """When a job writing up to `own_tokens` would finish, behind everything ahead of it, at the queue's
        rate (without a pace to time the job itself)."""
        return now + timedelta(seconds=(self.tokens_ahead + own_tokens) / self.tokens_per_s)


@dataclass(frozen=True)
class Pace:
    """A queue's workers' engine pace: the median of what its live workers published."""

    step_s: float  # seconds per engine step: one output token of each running request
    prefill_token_s: float  # seconds per prompt token computed

    def run_s(self, prompt_tokens: int, max_tokens: int) -> float:
        return prompt_tokens * self.prefill_token_s + max_tokens * self.step_s


@dataclass(frozen=True)
class Forecast:
    start_by: datetime | None  # latest start meeting the deadline; None: no deadline
    finish_at: datetime | None  # None: no prediction


def queue_rate(session: Session, queue: str, now: datetime) -> QueueRate | None:
    """The queue's measured rate and the work ahead, or None when nothing finished in the window."""
    delivered = session.execute(
        select(func.coalesce(func.sum(Job.completion_tokens), 0))
        .where(Job.queue == queue, status_is(SUCCEEDED), Job.finished_at > now - RATE_WINDOW)
    ).scalar_one()
    if not delivered:
        return None
    ahead = job_tallies.tallies(session, queue=queue).get(queue, job_tallies.QueueTally()).output_bound
    return QueueRate(int(delivered) / RATE_WINDOW.total_seconds(), ahead)


class QueueRates:
    """One process's last read of each queue's rate (`queue_rate`), reused for `refresh_s`, plus the output
    of the jobs this process admitted since. Thread-safe."""

    def __init__(self, refresh_s: float = RATE_REFRESH_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._refresh_s = refresh_s
        self._clock = clock
        self._lock = threading.Lock()
        self._read: dict[str, tuple[QueueRate | None, float]] = {}

    def rate(self, session: Session, queue: str, now: datetime) -> QueueRate | None:
        with self._lock:
            cached = self._read.get(queue)
        if cached is not None and self._clock() - cached[1] < self._refresh_s:
            return cached[0]
        read_at = self._clock()
        rate = queue_rate(session, queue, now)
        with self._lock:
            self._read[queue] = (rate, read_at)
        return rate

    def admitted(self, queue: str, output_tokens: int) -> None:
        """A job of `queue` that may write `output_tokens` was committed by this process."""
        with self._lock:
            cached = self._read.get(queue)
            if cached is not None and cached[0] is not None:
                rate, read_at = cached
                self._read[queue] = (replace(rate, tokens_ahead=rate.tokens_ahead + output_tokens), read_at)


def queue_pace(session: Session, queue: str, now: datetime, dead_after_s: float) -> Pace | None:
    """The median pace of the queue's live workers, or None when none published one."""
    published = [pace for pace in workers.paces(session, queue, now=now, dead_after_s=dead_after_s)
                 if _is_pace(pace)]
    if not published:
        return None
    return Pace(statistics.median(p["step_s"] for p in published),
                statistics.median(p["prefill_token_s"] for p in published))


def forecast(session: Session, queue: str, now: datetime, *, deadline_s: float | None, prompt_tokens: int,
             max_tokens: int, choices: int, dead_after_s: float, rates: QueueRates | None = None) -> Forecast:
    """A new job's latest start (with a deadline) and predicted finish; `rates`: the process's reused
    reads of the queue's rate (none: read now)."""
    pace = queue_pace(session, queue, now, dead_after_s)
    run_s = pace.run_s(prompt_tokens, max_tokens) if pace is not None else None
    start_by = latest_start(now, deadline_s, run_s) if deadline_s is not None else None
    rate = rates.rate(session, queue, now) if rates is not None else queue_rate(session, queue, now)
    if rate is None:
        return Forecast(start_by, None)
    if run_s is None:
        return Forecast(start_by, rate.finish_at(now, choices * max_tokens))
    return Forecast(start_by, now + timedelta(seconds=rate.wait_s() + run_s))


def latest_start(now: datetime, deadline_s: float, run_s: float | None) -> datetime:
    """The deadline less the job's run time (unknown: the deadline itself)."""
    return now + timedelta(seconds=deadline_s - (run_s or 0.0))


def _is_pace(rates: dict[str, float]) -> bool:
    return all(isinstance(rates.get(name), int | float) and rates[name] >= 0
               for name in ("step_s", "prefill_token_s"))
