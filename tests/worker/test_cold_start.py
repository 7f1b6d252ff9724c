"""The cold-start figures: the process start read from the OS, and the first-token line logged once."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conveyor.engine.stats import EngineTotals
from conveyor.worker import cold_start
from conveyor.worker.cold_start import ColdStart, process_start_monotonic


def test_the_process_start_comes_from_proc_and_precedes_the_imports() -> None:
    started = process_start_monotonic()
    assert started < cold_start.IMPORTED_AT  # the interpreter ran before this module was imported
    assert time.monotonic() - started < 24 * 3600


def test_a_command_name_with_spaces_and_parentheses_is_skipped(tmp_path: Path) -> None:
    ticks = int((time.clock_gettime(time.CLOCK_BOOTTIME) - 5.0) * os.sysconf("SC_CLK_TCK"))
    fields = ["S"] + ["0"] * 18 + [str(ticks)] + ["0"] * 10  # field 22 (starttime) is the 20th after ")"
    stat = tmp_path / "stat"
    stat.write_text(f"123 (a (b) c) {' '.join(fields)}\n")
    assert abs(time.monotonic() - process_start_monotonic(stat) - 5.0) < 0.1
    assert process_start_monotonic(tmp_path / "missing") == cold_start.IMPORTED_AT  # no /proc: the fallback


@dataclass
class FakeEngine:
    totals: EngineTotals = field(default_factory=EngineTotals)


@dataclass
class FakeHost:
    """What ColdStart uses of an EngineHost: step listeners and the engine's totals."""

    engine: FakeEngine = field(default_factory=FakeEngine)
    listeners: list[Any] = field(default_factory=list)

    def on_step_end(self, listener: Any) -> None:
        self.listeners.append(listener)

    def remove_step_listener(self, listener: Any) -> None:
        self.listeners.remove(listener)

    def step(self, generated: int, embedded: int = 0) -> None:
        self.engine.totals.generated_tokens += generated
        self.engine.totals.embedded_requests += embedded
        for listener in list(self.listeners):
            listener()


def test_first_token_is_logged_once_at_the_first_generated_token(caplog: pytest.LogCaptureFixture) -> None:
    host = FakeHost()
    start = ColdStart()
    start.watch_first_token(host)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="conveyor.cold_start"):
        host.step(0)  # a prefill chunk that sampled nothing yet
        assert start.first_token_s is None
        host.step(1)
        host.step(1)
    lines = [r.getMessage() for r in caplog.records if "first token" in r.getMessage()]
    assert len(lines) == 1 and lines[0].endswith("s after process start") and not host.listeners
    assert start.first_token_s is not None and start.first_token_s > 0


def test_an_embedding_engine_logs_its_first_embedding(caplog: pytest.LogCaptureFixture) -> None:
    host = FakeHost()
    start = ColdStart()
    start.watch_first_token(host)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="conveyor.cold_start"):
        host.step(0)  # a chunk of a long input: nothing pooled yet
        assert start.first_token_s is None
        host.step(0, embedded=3)
    lines = [r.getMessage() for r in caplog.records if "first embedding" in r.getMessage()]
    assert len(lines) == 1 and not host.listeners and start.first_token_s is not None
