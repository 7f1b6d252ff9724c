"""The measured cost of an engine step by the number of tokens it computes, which tells whether drafts pay.

A step's seconds and token count are kept per bucket of token counts (four buckets per doubling), as
exponential moving averages. Drafts pay while emitting more tokens per second than the step without them: at
a small batch a step is bound by reading the weights and extra tokens cost little; at a large one it is bound
by compute and each extra token costs as much as any other, so drafts that are not all accepted lose.

Between the buckets' average sizes the cost is interpolated linearly (beyond them, extended along the
nearest segment, never decreasing), so a few drafts added to a large step cost their share even when both
sizes fall in one bucket. A size whose own bucket was not measured lately is unknown: the speculator then
runs it to measure it rather than guess.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BUCKETS_PER_DOUBLING = 4
SMOOTHING = 0.2  # weight of the newest step in its bucket's averages
STALE_AFTER_STEPS = 256  # a bucket last measured this many steps ago is measured again


@dataclass
class _Bucket:
    tokens: float  # average token count of its steps
    seconds: float  # average seconds
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
        if bucket is None or self._stale(bucket):
            self._buckets[key] = _Bucket(num_tokens, seconds, self._steps)
            return
        bucket.tokens += SMOOTHING * (num_tokens - bucket.tokens)
        bucket.seconds += SMOOTHING * (seconds - bucket.seconds)
        bucket.last_step = self._steps

    def seconds(self, num_tokens: int) -> float | None:
        """The expected seconds of a step of num_tokens tokens; None while its bucket is unknown."""
        return self.curve().seconds(num_tokens)

    def curve(self) -> CostCurve:
        """The measured sizes as they are now, to ask many sizes of (a step's policy does)."""
        fresh = {key: b for key, b in self._buckets.items() if not self._stale(b)}
        return CostCurve(set(fresh), sorted((b.tokens, b.seconds) for b in fresh.values()))

    def _stale(self, bucket: _Bucket) -> bool:
        return self._steps - bucket.last_step > STALE_AFTER_STEPS


@dataclass(frozen=True)
class CostCurve:
    known: set[int]  # the buckets measured lately
    points: list[tuple[float, float]]  # their (average tokens, average seconds), by tokens

    def seconds(self, num_tokens: int) -> float | None:
        if bucket_of(num_tokens) not in self.known:
            return None
        return _interpolate(self.points, num_tokens)


def bucket_of(num_tokens: int) -> int:
    return round(BUCKETS_PER_DOUBLING * math.log2(max(num_tokens, 1)))


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """The piecewise-linear function through `points` (sorted by x) at x, extended beyond the ends along
    the end segments with a slope of at least 0; a single point is a constant."""
    if len(points) == 1:
        return points[0][1]
    i = next((i for i, (px, _) in enumerate(points) if px > x), len(points))  # the first point right of x
    left = min(max(i - 1, 0), len(points) - 2)  # the segment holding x, or the end one nearest to it
    (x0, y0), (x1, y1) = points[left], points[left + 1]
    slope = (y1 - y0) / (x1 - x0) if x1 > x0 else 0.0
    if not 0 < i < len(points):
        slope = max(slope, 0.0)
    return max(y0 + slope * (x - x0), 0.0)
