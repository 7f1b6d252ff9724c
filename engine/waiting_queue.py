"""The waiting requests of one request class, first in order (engine/sequence.py `order_key`) at any time.

A heap keyed by each request's order key when it was pushed. Keys only ever grow (a deadline that passes
turns into infinity), so the top is re-keyed lazily: when the top's key has grown, it is pushed back under its
new key and the next top is looked at. Admission stays O(log n) with many thousands waiting (the offline
LLM's whole workload waits here).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

from conveyor.engine.sequence import Sequence

_Key = tuple[int, int, float, int]


class WaitingQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[_Key, Sequence]] = []

    def push(self, seq: Sequence, now: float) -> None:
        heapq.heappush(self._heap, (seq.order_key(now), seq))

    def first(self, now: float) -> Sequence | None:
        """The request to admit next at time `now`, left in the queue."""
        while self._heap:
            key, seq = self._heap[0]
            current = seq.order_key(now)
            if current == key:
                return seq
            heapq.heapreplace(self._heap, (current, seq))
        return None

    def first_where(self, now: float, can_run: Callable[[Sequence], bool]) -> Sequence | None:
        """The first request at time `now` for which `can_run` holds, left in the queue: the first itself
        (O(log n)), else a scan in key order (only while some request cannot run, e.g. its LoRA adapter
        waits for a slot)."""
        first = self.first(now)
        if first is None or can_run(first):
            return first
        ordered = sorted(((seq.order_key(now), seq) for _, seq in self._heap), key=lambda entry: entry[0])
        return next((seq for _, seq in ordered if can_run(seq)), None)

    def remove(self, seq: Sequence) -> None:
        """Takes seq out: at once when it is the first (admission), else by a search (an abort)."""
        if self._heap and self._heap[0][1] is seq:
            heapq.heappop(self._heap)
            return
        index = next(i for i, (_, queued) in enumerate(self._heap) if queued is seq)
        self._heap[index] = self._heap[-1]
        self._heap.pop()
        if index < len(self._heap):
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Sequence]:
        """In order of the keys they were pushed with (for inspection, not admission)."""
        return iter([seq for _, seq in sorted(self._heap, key=lambda entry: entry[0])])
