"""The CPU time of each thread of a process, by thread name, between two samples, from Linux's /proc.

A sample reads /proc/PID/stat (the whole process: its threads alive or ended, user + system) and, per
thread, /proc/PID/task/TID/stat and its name (`comm`, 15 bytes at most). Between two samples each thread
alive at the second counts what it spent since the first (all of it if it started since); threads of one
name are added up. `ended` is what the process spent beyond its live threads' share: threads that ended in
between (a thread-pool worker let go, a short-lived helper). Nothing here changes the process.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
ENDED = "(ended threads)"


@dataclass(frozen=True)
class ThreadSample:
    """A process's CPU seconds (`total`, every thread it ever had) and per live thread: tid -> (name,
    CPU seconds)."""

    total: float
    threads: dict[int, tuple[str, float]]


def _cpu_s(stat_path: Path) -> float:
    """user + system seconds of /proc/.../stat (fields 14 and 15, after the parenthesised name)."""
    text = stat_path.read_text()
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sample_threads(pid: int, proc: Path = PROC) -> ThreadSample:
    """The process's CPU seconds and each live thread's; OSError when the process is gone."""
    base = proc / str(pid)
    total = _cpu_s(base / "stat")
    threads: dict[int, tuple[str, float]] = {}
    for task in (base / "task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            threads[int(task.name)] = (name, _cpu_s(task / "stat"))
        except OSError:  # ended between the listing and the read
            continue
    return ThreadSample(total, threads)


def cpu_by_name(before: ThreadSample, after: ThreadSample) -> dict[str, float]:
    """CPU seconds per thread name between two samples, and ENDED for threads gone in between (never < 0).
    The values add up to the process's CPU seconds in between."""
    spent: dict[str, float] = defaultdict(float)
    for tid, (name, cpu) in after.threads.items():
        earlier = before.threads.get(tid)
        spent[name] += cpu - earlier[1] if earlier is not None else cpu
    spent[ENDED] = max(after.total - before.total - sum(spent.values()), 0.0)
    return dict(spent)
