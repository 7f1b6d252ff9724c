"""Turning the engine's per-step outputs into text deltas of running jobs (the worker side of
core/seams/token_stream.py).

`JobStreamer` publishes at most one delta per STREAM_EVERY_TOKENS tokens or STREAM_EVERY_S seconds per job,
and only for jobs someone listens to; sinks (worker/token_sinks.py) never block the engine thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from conveyor.core.seams.token_stream import TokenEvent, TokenSink
from conveyor.engine.outputs import RequestOutput
from conveyor.worker.storable_text import storable

STREAM_EVERY_TOKENS = 4
STREAM_EVERY_S = 0.05


@dataclass
class _Progress:
    attempt: int
    sent_chars: int = 0
    unsent_tokens: int = 0
    last_sent: float = 0.0


class JobStreamer:
    """Per-choice delta bookkeeping between the engine thread (update) and the finisher thread (end)."""

    def __init__(self, sink: TokenSink, clock: Callable[[], float] = time.monotonic) -> None:
        self._sink = sink
        self._clock = clock
        self._lock = threading.Lock()
        self._progress: dict[tuple[str, int], _Progress] = {}  # (job id, choice index)

    def update(self, job_id: str, attempt: int, out: RequestOutput, index: int = 0) -> None:
        if not self._sink.listening(job_id):
            return
        with self._lock:
            progress = self._progress.setdefault((job_id, index), _Progress(attempt))
        progress.unsent_tokens += max(out.num_new_tokens, 1)
        now = self._clock()
        due = progress.unsent_tokens >= STREAM_EVERY_TOKENS or now - progress.last_sent >= STREAM_EVERY_S
        # NOTE: the text may shrink at the end (cut before a stop string); the API holds back enough
        # characters to cover that and reconciles with the stored text. Each piece is storable as the stored
        # text is, so that the pieces join to it.
        delta = storable(out.text[progress.sent_chars:])
        if delta and (due or out.finished):
            self._sink.publish(job_id, TokenEvent(attempt, delta, tokens=len(out.token_ids), index=index))
            progress.sent_chars, progress.unsent_tokens, progress.last_sent = len(out.text), 0, now

    def end(self, job_id: str, attempt: int) -> None:
        """After the job's outcome is stored (or it was handed back): listeners read the store now."""
        with self._lock:
            for key in [key for key in self._progress if key[0] == job_id]:
                del self._progress[key]
        self._sink.publish(job_id, TokenEvent(attempt, end=True))
