"""What the service bench reads of other processes, from Linux's /proc: CPU times (user, system, and those of
reaped children, as `psutil.Process.cpu_times()` gives them), parents, threads. Nothing here changes anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class ProcTimes:
    """One process's CPU seconds since it started; `children_*`: of its children it has waited for."""

    user: float
    system: float
    children_user: float = 0.0
    children_system: float = 0.0

    @property
    def total(self) -> float:
        return self.user + self.system + self.children_user + self.children_system


# A process is known by its pid and its start time (clock ticks after boot): a pid can be used again.
ProcKey = tuple[int, int]


def _stat_fields(pid: int, proc: Path = PROC) -> list[str]:
    """The fields of /proc/PID/stat after the command name (which may hold spaces and parentheses): index 0
    is field 3 (state), so field N is at index N - 3."""
    text = (proc / str(pid) / "stat").read_text()
    return text[text.rindex(")") + 2 :].split()


def parse_times(fields: list[str], ticks_per_s: float) -> ProcTimes:
    utime, stime, cutime, cstime = (int(fields[i]) / ticks_per_s for i in (11, 12, 13, 14))
    return ProcTimes(utime, stime, cutime, cstime)


def read_times(pid: int, proc: Path = PROC) -> tuple[ProcKey, ProcTimes]:
    """(pid, start time) and CPU times of one process; OSError when it is gone."""
    fields = _stat_fields(pid, proc)
    return (pid, int(fields[19])), parse_times(fields, os.sysconf("SC_CLK_TCK"))


def parents(proc: Path = PROC) -> dict[int, int]:
    """pid -> parent pid, for every process visible now."""
    out: dict[int, int] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = int(_stat_fields(int(entry.name), proc)[1])
            except (OSError, ValueError, IndexError):  # gone meanwhile
                continue
    return out


def descendants(pid: int, parent_of: dict[int, int]) -> list[int]:
    """`pid`'s children, their children and so on (not `pid` itself), from a pid -> parent map."""
    children: dict[int, list[int]] = {}
    for child, parent in parent_of.items():
        children.setdefault(parent, []).append(child)
    found, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def tree(pid: int, proc: Path = PROC) -> list[int]:
    """The process and every descendant alive now."""
    return [pid, *descendants(pid, parents(proc))]


def threads(pid: int, proc: Path = PROC) -> list[int]:
    """The thread ids of a process (empty when it is gone)."""
    try:
        return [int(t.name) for t in (proc / str(pid) / "task").iterdir()]
    except OSError:
        return []
