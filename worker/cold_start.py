"""A worker's cold start: process start -> imports done -> engine ready -> first token, one log line at each
of the last two, so an operator (or an autoscaler's tuning) knows how long a new worker takes to be useful.

The process start comes from the OS, not from a timestamp taken in Python: the interpreter's own start and
the first imports are part of a cold start too. On Linux it is /proc/self/stat's `starttime` (clock ticks
since boot, 10 ms resolution) against CLOCK_BOOTTIME, the clock it is counted on; elsewhere, the moment
this module was first imported (which misses the interpreter's start).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from conveyor.engine.host import EngineHost
from conveyor.engine.loader import LoadTimings

log = logging.getLogger("conveyor.cold_start")

IMPORTED_AT = time.monotonic()  # the fallback process start
STARTTIME_FIELD = 22  # /proc/<pid>/stat, 1-based (proc(5))


def process_start_monotonic(stat_path: Path = Path("/proc/self/stat")) -> float:
    """When the OS started this process, on time.monotonic()'s scale."""
    age = _process_age_s(stat_path)
    return IMPORTED_AT if age is None else time.monotonic() - age


def _process_age_s(stat_path: Path) -> float | None:
    try:
        # The command name (field 2) is in parentheses and may hold spaces: count fields after its ")".
        after_name = stat_path.read_text().rsplit(")", 1)[1].split()
        ticks = int(after_name[STARTTIME_FIELD - 3])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux, or no /proc
        return None


@dataclass
class ColdStart:
    """Create it when the worker's imports are done; then engine_ready() once, watch_first_token() once."""

    started: float = field(default_factory=process_start_monotonic)
    imports_done: float = field(default_factory=time.monotonic)
    engine_ready_s: float | None = None
    first_token_s: float | None = None

    def since_start(self) -> float:
        return time.monotonic() - self.started

    def engine_ready(self, host: EngineHost) -> float:
        """Logs the engine-ready line, with its phases; returns the seconds since process start."""
        self.engine_ready_s = self.since_start()
        imports_s = self.imports_done - self.started
        runner = host.engine.runner
        timings = getattr(runner, "load_timings", None)  # a test double runner has none
        if isinstance(timings, LoadTimings):
            rest_s = (self.engine_ready_s - imports_s - timings.attention_s - timings.weights_s
                      - timings.kv_cache_s)
            held_bytes = getattr(runner, "weight_bytes", 0)
            held = f"{getattr(runner, 'quantization', 'none')}, {held_bytes / 2**20:.1f} MiB"
            log.info("cold start: engine ready %.1f s after process start (imports %.1f s, attention kernel "
                     "%.2f s, weights %.2f s (%s), KV cache %.2f s, the rest %.1f s)", self.engine_ready_s,
                     imports_s, timings.attention_s, timings.weights_s, held, timings.kv_cache_s, rest_s)
        else:
            log.info("cold start: engine ready %.1f s after process start (imports %.1f s)",
                     self.engine_ready_s, imports_s)
        return self.engine_ready_s

    def watch_first_token(self, host: EngineHost) -> None:
        """Logs, once, when the engine has produced its first output (of whichever job came first): a
        generated token, or an embedding engine's first vector."""

        def on_step_end() -> None:  # on the engine thread, after every step until the first output
            totals = host.engine.totals
            if totals.generated_tokens == 0 and totals.embedded_requests == 0:
                return
            host.remove_step_listener(on_step_end)
            self.first_token_s = self.since_start()
            what = "first token" if totals.generated_tokens else "first embedding"
            log.info("cold start: %s %.1f s after process start", what, self.first_token_s)

        host.on_step_end(on_step_end)
