"""Admission control without a COUNT per submit: each queue's queued-job count, estimated per API process.

The estimate is the last COUNT of the queue's queued jobs plus the jobs this process admitted since. It is
re-counted when it is older than REFRESH_S, and whenever it says the queue is full, so a queue that drained
is never refused on a stale number. What it can miss are other API processes' admissions since the last
count: with R replicas each admitting at most A jobs per REFRESH_S, a queue overshoots `max_queued` by at
most about (R - 1) x A (README, "Admission control"). Jobs leaving the queue are not subtracted between
counts, so the estimate errs towards "full", and a full verdict is always re-counted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.orm import Session

from core.store import jobs

REFRESH_S = 0.5


@dataclass
class _Estimate:
    queued: int
    counted_at: float


class AdmissionGauge:
    def __init__(self, refresh_s: float = REFRESH_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._refresh_s = refresh_s
        self._clock = clock
        self._lock = threading.Lock()
        self._estimates: dict[str, _Estimate] = {}

    def has_room(self, session: Session, queue: str, max_queued: int) -> bool:
        """Whether one more job fits under `max_queued`; counts the queue's rows only when the estimate is
        stale or says no."""
        with self._lock:
            estimate = self._estimates.get(queue)
            fresh = estimate is not None and self._clock() - estimate.counted_at < self._refresh_s
            if fresh and estimate is not None and estimate.queued < max_queued:
                return True
        counted_at = self._clock()
        queued = jobs.count_queued(session, queue)
        with self._lock:
            self._estimates[queue] = _Estimate(queued, counted_at)
        return queued < max_queued

    def admitted(self, queue: str) -> None:
        """One more job of `queue` was committed by this process."""
        with self._lock:
            estimate = self._estimates.get(queue)
            if estimate is not None:
                estimate.queued += 1
