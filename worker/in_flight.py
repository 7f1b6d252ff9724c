"""The attempts in flight in this worker, by request id: from the claim until the outcome is stored and the
caller told. Every change wakes whoever waits on them (room in a queue, an idle runner at shutdown)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime

from conveyor.core.clock import utcnow
from conveyor.worker.attempt import Attempt

IDLE_TICK_S = 0.1  # how often wait_idle calls its tick while attempts remain


class InFlight:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._attempts: dict[str, Attempt] = {}  # by request id
        self._claims: dict[int, datetime] = {}  # claims on their way from the store: when each began
        self._claim_ids = itertools.count()

    def __len__(self) -> int:
        with self._lock:
            return len(self._attempts)

    def add(self, attempt: Attempt) -> None:
        with self._lock:
            self._attempts[attempt.request_id] = attempt

    def remove(self, attempt: Attempt) -> None:
        with self._lock:
            self._attempts.pop(attempt.request_id, None)
            self._changed.notify_all()

    def rekey(self, attempt: Attempt, request_id: str) -> None:
        """The attempt goes on under a new request id (its retry in the engine)."""
        with self._lock:
            self._attempts.pop(attempt.request_id, None)
            attempt.request_id = request_id
            self._attempts[request_id] = attempt

    def admitted(self, attempt: Attempt) -> None:
        """The engine has the attempt (its grammar compiled): it counts in its queue's room from now on."""
        with self._lock:
            attempt.compiling = False
            self._changed.notify_all()

    def snapshot(self) -> list[Attempt]:
        with self._lock:
            return list(self._attempts.values())

    def held(self) -> set[tuple[str, int]]:
        """(job id, attempt) of every attempt in flight, its outcome written or not."""
        with self._lock:
            return {(a.job_id, a.attempt) for a in self._attempts.values()}

    @contextmanager
    def claiming(self) -> Iterator[None]:
        """Around a claim and the adding of the attempts it got: until they are in flight, the reconciler
        must not take the jobs claimed since the claim began for claims lost on their way here."""
        with self._lock:
            claim = next(self._claim_ids)
            self._claims[claim] = utcnow()
        try:
            yield
        finally:
            with self._lock:
                del self._claims[claim]

    def claims_since(self) -> datetime | None:
        """When the oldest claim still on its way here began; None when there is none."""
        with self._lock:
            return min(self._claims.values(), default=None)

    def wait_until(self, predicate: Callable[[list[Attempt]], bool], timeout_s: float) -> bool:
        """Blocks until predicate(the attempts in flight) holds, or timeout_s passes; says which. The
        predicate runs under the lock: it must not call back into this object."""
        with self._lock:
            return self._changed.wait_for(lambda: predicate(list(self._attempts.values())), timeout_s)

    def wait_idle(self, timeout_s: float, tick: Callable[[], None] | None = None) -> bool:
        """Waits until no attempt is in flight, calling `tick` (e.g. flush acks) every IDLE_TICK_S in this
        thread. Says whether none is left."""
        deadline = time.monotonic() + timeout_s
        while True:
            if tick is not None:
                tick()
            with self._lock:
                remaining = deadline - time.monotonic()
                if not self._attempts or remaining <= 0:
                    return not self._attempts
                self._changed.wait(min(IDLE_TICK_S, remaining))
