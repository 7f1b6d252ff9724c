"""When the batch runner reads a batch's next chunk: once the batch's window has room for a good part of one.

A batch keeps at most `window` (batch_window_jobs) of its jobs queued or running. Refilling the window the
moment one job ends reads a chunk of one or two lines, and a chunk has fixed costs whatever its size (the
lease, the limits of the lines' models, the fenced commit, the publish): at a few lines per chunk they were
most of a line's CPU. So a chunk is read once the room reaches `refill` (half the window, at most a chunk,
at least one line), while the other half still feeds the engine.

Until then the runner waits, and the wait is timed from the pace the batch's lines end at (lines that
ended / seconds, between two chunks, or since the last chunk when some ended since): the time until `refill`
lines will have room (and a margin), within [MIN_WAIT_S, the longest wait the runner allows]. Without a pace,
the runner's interval. A round checking too early costs a round's statements for nothing, so the wait is not
cut to the interval: the runner bounds it (worker/batches/runner.py PACED_WAIT_INTERVALS).
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_WAIT_S = 0.005  # a shorter wait costs a round (a few statements) for a line or two
# The wait aims a little past the time the pace gives: lines end in bursts (an engine step's worth at once),
# and a round that comes too early finds too little room and costs a round more (half the window is still
# queued meanwhile, so the engine never waits for this margin).
WAIT_MARGIN = 1.25


@dataclass(frozen=True)
class _LastChunk:
    at_s: float  # monotonic seconds
    active: int  # the batch's lines queued or running right after it
    per_s: float | None  # lines ended per second from the chunk before to this one; None: not known


class RefillPace:
    def __init__(self, window: int, chunk_lines: int) -> None:
        if window < 1 or chunk_lines < 1:
            raise ValueError(f"window and chunk_lines must be >= 1, got {window} and {chunk_lines}")
        self.window = window
        self.refill = max(1, min(chunk_lines, window // 2))
        self._last: dict[str, _LastChunk] = {}  # by batch id

    def room(self, active: int) -> int:
        """The jobs the batch may add with `active` lines queued or running."""
        return self.window - active

    def ready(self, active: int) -> bool:
        """Whether a chunk is worth reading with `active` lines queued or running."""
        return self.room(active) >= self.refill

    def read(self, batch_id: str, active: int, added: int, at_s: float) -> None:
        """A chunk of `added` jobs was committed when `active` lines were queued or running."""
        last = self._last.get(batch_id)
        per_s = self._pace_since(last, active, at_s) if last is not None else None
        self._last[batch_id] = _LastChunk(at_s, active + added, per_s)

    def wait_s(self, batch_id: str, active: int, at_s: float, interval_s: float, longest_s: float) -> float:
        """How long until the room reaches `refill` at the batch's latest pace, at most `longest_s`;
        `interval_s` without a pace."""
        last = self._last.get(batch_id)
        per_s = self._pace_since(last, active, at_s) if last is not None else None
        if not per_s:
            return interval_s
        needed = self.refill - self.room(active)
        return min(max(WAIT_MARGIN * needed / per_s, MIN_WAIT_S), longest_s)

    def forget(self, batch_id: str) -> None:
        self._last.pop(batch_id, None)

    @staticmethod
    def _pace_since(last: _LastChunk, active: int, at_s: float) -> float | None:
        """Lines ended per second since `last`, when some did; else the pace `last` knew."""
        ended, elapsed = last.active - active, at_s - last.at_s
        return ended / elapsed if ended > 0 and elapsed > 0 else last.per_s
