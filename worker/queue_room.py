"""Each queue's room in this worker: how many more of its jobs may start, against its max_running.

The Celery consumer and the embedded feeders take a job only when its queue has room here. A job with n
choices, or an embedding job with n inputs, takes n places (each is a sequence in the engine); one that needs
more places than are free still starts when any is, so no job waits forever for a room it can never have.

NOTE: attempts waiting for their grammar do not count against the limit: a tenant's costly schemas hold up
no one's start (any cap on them, once reached, would). What bounds them is the claim: fair share hands a
tenant its share of the claims, its max_running caps its running jobs fleet-wide, and the compile thread
takes tenants in turn (engine/structured_output/compile_queue.py).
"""

from __future__ import annotations

import sys

from conveyor.worker.attempt import Attempt
from conveyor.worker.in_flight import InFlight


class QueueRoom:
    def __init__(self, limits: dict[str, int], in_flight: InFlight) -> None:
        """`limits`: queue -> max_running in this worker; a queue not named is never held."""
        self.limits = dict(limits)
        self._in_flight = in_flight

    def room(self, queue: str) -> int:
        """How many more jobs of `queue` may start now (sys.maxsize for a queue without a limit here)."""
        return self._room(queue, self._in_flight.snapshot())

    def has_room(self, queue: str) -> bool:
        """Whether a job of `queue` may start now: fewer than its max_running places are taken here."""
        return self.room(queue) > 0

    def wait_for_room(self, queue: str, timeout_s: float) -> bool:
        """Blocks until has_room(queue) or timeout_s passes; says which."""
        return self._in_flight.wait_until(lambda attempts: self._room(queue, attempts) > 0, timeout_s)

    def _room(self, queue: str, attempts: list[Attempt]) -> int:
        limit = self.limits.get(queue)
        if limit is None:
            return sys.maxsize
        in_engine = sum(a.n for a in attempts if a.queue == queue and not a.compiling)
        return max(0, limit - in_engine)
