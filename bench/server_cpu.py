"""The CPU time a service's processes spend during a bench run, per completed job and per core.

Each server role (`api`, `worker`, or `server` for the embedded service) is a process tree: the process
given with `--server-pid ROLE=PID` and its descendants. Its CPU time is user + system, children's included
(as `psutil.Process.cpu_times()` counts them), sampled from /proc right before and right after the measured
window (bench/procfs.py). From those: the role's CPU seconds in the window, the cores it kept busy (CPU
seconds / wall seconds), milliseconds of CPU per completed job, and completed jobs per second per core
(completed jobs / CPU seconds, which is jobs/s divided by the cores used).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from conveyor.bench.procfs import ProcKey, ProcTimes, read_times, tree

TreeSample = dict[ProcKey, ProcTimes]
UNKNOWN_NO_PID = (
    "server CPU unknown: the bench does not start the server; give its processes with --server-pid ROLE=PID"
)


def sample_tree(pid: int) -> TreeSample:
    """The CPU times of the process and its descendants now; empty when the process is gone."""
    sample: TreeSample = {}
    for p in tree(pid):
        try:
            key, times = read_times(p)
        except (OSError, ValueError, IndexError):  # ended between the listing and the read
            continue
        sample[key] = times
    return sample


def tree_cpu_s(before: Mapping[ProcKey, ProcTimes], after: Mapping[ProcKey, ProcTimes]) -> float:
    """CPU seconds a process tree spent between two samples. Each process of `after` counts what it spent
    since `before` (all of it if it started since); its children's times hold those of children it waited
    for, so a process that ended in between is counted in its parent's, whole: its share from before the
    window is taken off again. Never below 0."""
    spent = sum(t.total - before[k].total if k in before else t.total for k, t in after.items())
    gone = sum(t.total for k, t in before.items() if k not in after)
    return max(spent - gone, 0.0)


def cpu_figures(cpu_s: float | None, wall_s: float | None, completed: int) -> dict[str, float | None]:
    """Per completed job and per core: CPU ms per job, cores used (CPU s / wall s), completed jobs/s per core
    used (= completed / CPU s)."""
    known = cpu_s is not None
    return {
        "cpu_s": cpu_s,
        "cores_used": cpu_s / wall_s if known and wall_s else None,
        "cpu_ms_per_job": 1000 * cpu_s / completed if known and completed else None,
        "jobs_per_s_per_core": completed / cpu_s if known and cpu_s else None,
    }


class CpuWindow:
    """`start()` then `stop()` around the measured run: each role's CPU seconds in between."""

    def __init__(self, roles: Mapping[str, int]) -> None:
        self.roles = dict(roles)
        self.before: dict[str, TreeSample] = {}
        self.started = 0.0

    def start(self) -> CpuWindow:
        self.before = {role: sample_tree(pid) for role, pid in self.roles.items()}
        self.started = time.monotonic()
        return self

    def stop(self) -> dict[str, Any]:
        wall = time.monotonic() - self.started
        roles = {role: self._role(role, pid, sample_tree(pid)) for role, pid in self.roles.items()}
        return {"window_s": wall, "roles": roles}

    def _role(self, role: str, pid: int, after: TreeSample) -> dict[str, Any]:
        before = self.before[role]
        known = bool(before) and bool(after)
        return {
            "pid": pid,
            "processes": len(after),
            "cpu_s": tree_cpu_s(before, after) if known else None,
            "note": None if known else f"process {pid} not found {'after' if before else 'before'} the run",
        }


def server_figures(measured: dict[str, Any] | None, completed: int) -> dict[str, Any]:
    """Per role (and `total` when there are several): its CPU figures; `unknown` says why when none."""
    roles = (measured or {}).get("roles") or {}
    wall = (measured or {}).get("window_s")
    out: dict[str, Any] = {"window_s": wall, "roles": {}, "unknown": None if roles else UNKNOWN_NO_PID}
    for role, m in roles.items():
        out["roles"][role] = {"pid": m["pid"], "note": m["note"], **cpu_figures(m["cpu_s"], wall, completed)}
    known = [m["cpu_s"] for m in roles.values()]
    if len(roles) > 1:
        total = None if None in known else sum(known)
        out["roles"]["total"] = {"pid": None, "note": None, **cpu_figures(total, wall, completed)}
    if roles and None in known:
        out["unknown"] = "; ".join(m["note"] for m in roles.values() if m["note"])
    return out
