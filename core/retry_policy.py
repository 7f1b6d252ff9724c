"""Which failures the system retries on its own, how often, and after how long.

A failure is retryable when it says nothing about the request: the engine ran out of device memory (after
its one retry on the same worker, worker/transient.py), or the model could not be loaded yet (an adapter's
files unreadable for now). The request's own errors (invalid_request, timeout) never are. A job gets
`max_retries` of them (its own, else its queue's default); each waits an exponential backoff with jitter in
status `scheduled`, so many jobs failing at once do not come back at once. A job whose worker died is
requeued at once instead, counted against the same `max_retries` (core/store/jobs/recovery.py
requeue_orphans): the job did nothing wrong, and another worker can take it now.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

OUT_OF_MEMORY = "out_of_memory"  # the engine ran out of device memory on the job's step, twice
MODEL_UNAVAILABLE = "model_unavailable"  # its model or adapter could not be loaded (yet)
WORKER_LOST = "worker_lost"  # its worker died while running it
RETRYABLE_CODES = (OUT_OF_MEMORY, MODEL_UNAVAILABLE)  # rescheduled with a backoff (worker loss: at once)
DEFAULT_MAX_RETRIES = 2


@dataclass(frozen=True)
class Backoff:
    """Retry k (1, 2, ...) waits between half and all of min(cap_s, base_s x 2^(k-1)) seconds."""

    base_s: float = 2.0
    cap_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0 < self.base_s <= self.cap_s:
            raise ValueError(f"backoff: need 0 < base_s <= cap_s, got {self.base_s} and {self.cap_s}")

    def delay_s(self, retry: int, rng: random.Random | None = None) -> float:
        assert retry >= 1, retry
        ceiling = min(self.cap_s, self.base_s * 2.0 ** min(retry - 1, 60))
        return ceiling / 2 + (rng or random).uniform(0, ceiling / 2)
