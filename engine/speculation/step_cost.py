"""The measured cost of an engine step by the number of tokens it computes, which tells whether drafts pay.

A step's seconds are kept per bucket of token counts (four buckets per doubling), as an exponential moving
average. Drafts pay while emitting more tokens per second than the step without them: at a small batch a
step is bound by reading the weights and extra tokens cost little; at a large one it is bound by compute
and each extra token costs as much as any other, so drafts that are not all accepted lose. A bucket not
measured lately is unknown: the speculator then measures it (runs the step) rather than guess.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BUCKETS_PER_DOUBLING = 4
SMOOTHING = 0.2  # weight of the newest step in its bucket's average
STALE_AFTER_STEPS = 256  # a bucket last measured this many steps ago is measured again


@dataclass
class _Bucket:
    seconds: float
    last_step: int


class StepCost:
    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}
        self._steps = 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One finished step: its computed tokens (drafts included) and its wall-clock seconds."""
        if num_tokens < 1 or seconds <= 0:
            return
        self._steps += 1
        key = bucket_of(num_tokens)
        bucket = self._buckets.get(key)
        if bucket is None or self._steps - bucket.last_step > STALE_AFTER_STEPS:
            self._buckets[key] = _Bucket(seconds, self._steps)
            return
        bucket.seconds += SMOOTHING * (seconds - bucket.seconds)
        bucket.last_step = self._steps

    def seconds(self, num_tokens: int) -> float | None:
        """The expected seconds of a step of num_tokens tokens; None while unknown (not measured lately)."""
        bucket = self._buckets.get(bucket_of(num_tokens))
        if bucket is None or self._steps - bucket.last_step > STALE_AFTER_STEPS:
            return None
        return bucket.seconds


def bucket_of(num_tokens: int) -> int:
    return round(BUCKETS_PER_DOUBLING * math.log2(max(num_tokens, 1)))
