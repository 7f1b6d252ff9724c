"""Choosing torch's intra-op thread count on CPU by measuring it, not by counting cores.

torch's OpenMP threads meet at a barrier at the end of every parallel op, so an op lasts as long as its
slowest thread. Where the vCPUs are shared (with other processes, or with other tenants of the host:
/proc/stat's steal time), a thread that is not running when the op starts holds up the whole step, and the
small matmuls of a decode step gain little from being split anyway. Nothing in the CPU topology tells
whether that is so; a short timed matmul at each thread count does.

The engine never calls this: it applies only an explicit `num_threads`, so a configuration means the same on
every run. The service and the bench call `choose_cpu_threads` once at start, when no count was given.
Everything comes in as arguments or from the OS (the affinity mask, the cgroup's CPU quota); like the rest
of the engine, this module reads no environment variables.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from conveyor.engine.loader import resolve_device

CGROUP_ROOT = Path("/sys/fs/cgroup")
DECODE_BATCH = 16  # rows of the timed matmul: a decode step of a moderately busy engine
MLP_RATIO = 4  # [hidden] -> [4 * hidden]: the shape of an MLP's up projection
# The timed weight is [hidden, 4 * hidden] fp32, capped so that a large model's start costs at most 64 MiB
# and a fraction of a second here. A larger matmul splits at least as well: the cap does not favour threads.
MAX_TIMED_HIDDEN = 2048
DEFAULT_HIDDEN = 1024  # when the model's config.json gives none
# Candidates take turns for ROUNDS rounds, so that other work coming and going on the shared CPUs hits each of
# them alike, rather than deciding by which one happened to run during a quiet moment. Each turn repeats the
# matmul for a slice of TIMING_BUDGET_S (plus one untimed warm-up call): a small model's turn lasts as long as
# a large one's, long enough to see the other work, and the whole choice stays well under a second.
ROUNDS = 3
TIMING_BUDGET_S = 0.12
# The fewest threads within this share of the fastest count are kept: more threads must be clearly faster,
# so that noise does not flip the choice.
CLEARLY_FASTER = 0.10


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs this process may use."""

    affinity_cpus: int  # CPUs in the process's affinity mask (taskset, a container's cpuset)
    cgroup_quota: float | None  # CPUs' worth of the cgroup's CPU quota; None: no quota

    @property
    def available(self) -> int:
        # A quota of 1.5 CPUs cannot keep 2 busy threads running: the second one's time is throttled for the
        # rest of each period, and every op waits for it. So the quota rounds down (at least 1).
        if self.cgroup_quota is None:
            return self.affinity_cpus
        return max(1, min(self.affinity_cpus, math.floor(self.cgroup_quota)))


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str
    timings_ms: dict[int, float]  # threads -> mean ms per step-sized matmul; empty when nothing was timed
    available_cpus: int
    affinity_cpus: int
    cgroup_quota: float | None

    def describe(self) -> str:
        """E.g. "1 of 2 CPUs (1: 3.1 ms, 2: 5.4 ms per step-sized matmul; fastest)"."""
        timed = ", ".join(f"{n}: {ms:.2f} ms" for n, ms in sorted(self.timings_ms.items()))
        timed = f"{timed} per step-sized matmul; " if timed else ""
        return f"{self.threads} of {self.available_cpus} CPUs ({timed}{self.reason})"


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2's cpu.max ("QUOTA PERIOD", QUOTA "max" when unlimited) as CPUs, or None when unlimited."""
    quota, _, period = text.strip().partition(" ")
    if quota == "max" or not period:
        return None
    return int(quota) / int(period)


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota of the cgroup mounted at `root` (v2's cpu.max, else v1's cfs quota), in CPUs."""
    try:
        cpu_max = root / "cpu.max"
        if cpu_max.is_file():
            return parse_cpu_max(cpu_max.read_text())
        quota_file, period_file = root / "cpu" / "cpu.cfs_quota_us", root / "cpu" / "cpu.cfs_period_us"
        if quota_file.is_file() and period_file.is_file():
            quota, period = int(quota_file.read_text()), int(period_file.read_text())
            return quota / period if quota > 0 and period > 0 else None  # -1: no quota
    except (OSError, ValueError):  # unreadable or unexpected: no quota known, the affinity mask decides
        return None
    return None


def cpu_budget(root: Path = CGROUP_ROOT) -> CpuBudget:
    # sched_getaffinity is Linux-only; elsewhere every CPU counts.
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return CpuBudget(affinity_cpus=affinity, cgroup_quota=cgroup_cpu_quota(root))


def runs_on_cpu(device: str) -> bool:
    """Whether an engine configured with `device` ("auto", "cpu", "cuda:N") runs on the CPU, where a thread
    count is worth measuring. A device torch does not know is not (the runner refuses it with a message)."""
    try:
        return resolve_device(device).type == "cpu"
    except RuntimeError:
        return False


def candidate_counts(available: int) -> list[int]:
    """1, 2, 4, ... below `available`, and `available` itself."""
    counts, n = [], 1
    while n < available:
        counts.append(n)
        n *= 2
    return [*counts, available]


def hidden_size_of(model_path: str) -> int:
    """The model's hidden size from its config.json (or its text_config), else DEFAULT_HIDDEN."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return DEFAULT_HIDDEN
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    hidden = config.get("hidden_size") or text_config.get("hidden_size")
    return hidden if isinstance(hidden, int) and hidden > 0 else DEFAULT_HIDDEN


def decode_matmul_timer(hidden_size: int, slice_s: float) -> Callable[[], float]:
    """A function timing a [DECODE_BATCH, hidden] x [hidden, 4 * hidden] fp32 matmul at torch's current
    thread count: the mean ms of the calls that fit in slice_s (at least one). The operands are made once."""
    hidden = min(hidden_size, MAX_TIMED_HIDDEN)
    # Constant values: an fp32 matmul's speed does not depend on (normal) values, filling is cheaper than
    # drawing random ones, and the global RNG (sampling's) stays untouched.
    x = torch.full((DECODE_BATCH, hidden), 0.5)
    w = torch.full((hidden, MLP_RATIO * hidden), 0.01)

    def mean_ms() -> float:
        torch.mm(x, w)  # untimed: the first call at a new count wakes the thread pool
        calls, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < slice_s or calls == 0:
            torch.mm(x, w)
            calls += 1
        return elapsed / calls * 1e3

    return mean_ms


def pick(timings_ms: dict[int, float], margin: float = CLEARLY_FASTER) -> tuple[int, str]:
    """The fewest threads within `margin` of the fastest count, and why."""
    fastest = min(timings_ms, key=lambda n: (timings_ms[n], n))
    chosen = min(n for n, ms in timings_ms.items() if ms <= timings_ms[fastest] * (1 + margin))
    if chosen == fastest:
        return chosen, "fastest"
    return chosen, f"within {margin:.0%} of the fastest ({fastest} threads), fewer threads"


def choose_cpu_threads(
    hidden_size: int,
    candidates: list[int] | None = None,
    *,
    budget: CpuBudget | None = None,
    measure: Callable[[], float] | None = None,
) -> ThreadChoice:
    """Calls `measure()` (ms; default: decode_matmul_timer's) at each candidate thread count up to
    the CPUs this process may use (default budget: cpu_budget()), ROUNDS times in turn, and returns the
    choice. torch's thread setting is restored afterwards: the caller applies the choice."""
    budget = budget or cpu_budget()
    available = budget.available
    counts = sorted({n for n in (candidates or candidate_counts(available)) if 1 <= n <= available} or {1})
    if counts == [1]:  # nothing to compare: one thread is the only count that fits
        reason = "one CPU available" if available == 1 else "no other candidate fits the CPUs"
        return ThreadChoice(1, reason, {}, available, budget.affinity_cpus, budget.cgroup_quota)
    measure = measure or decode_matmul_timer(hidden_size, TIMING_BUDGET_S / (ROUNDS * len(counts)))
    before = torch.get_num_threads()
    samples: dict[int, list[float]] = {n: [] for n in counts}
    try:
        for _ in range(ROUNDS):
            for n in counts:
                torch.set_num_threads(n)
                samples[n].append(measure())
    finally:
        torch.set_num_threads(before)
    # The mean, not the median: a step waits for its slowest thread, so the stalls of a thread that was not
    # running are part of what a step costs, and must count in full.
    timings = {n: statistics.fmean(ms) for n, ms in samples.items()}
    threads, reason = pick(timings)
    return ThreadChoice(threads, reason, timings, available, budget.affinity_cpus, budget.cgroup_quota)
