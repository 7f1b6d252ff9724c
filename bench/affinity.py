"""CPU pinning for HTTP runs: the service on some CPUs, the load generator (the bench's own process) on the
others, so that the client's CPU does not count against the server's.

By default, on a machine where the bench may use at least 2 CPUs, the server gets the first half (rounded
up) and the bench the rest; on 1 CPU nothing is pinned and the report says so. `--server-cpus` /
`--client-cpus` choose (one given: the other gets the remaining CPUs). The bench pins every thread of its
own process, and every thread of each `--server-pid` process and its descendants (threads and processes
created later inherit the mask), with `os.sched_setaffinity`; after the run each thread it pinned gets its
mask back. A server started without `--server-pid` is not pinned by the bench: start it under
`taskset -c CPUS` (its thread count is chosen at start, from the CPUs it may use).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from conveyor.bench.procfs import threads, tree


@dataclass(frozen=True)
class CpuSplit:
    server: tuple[int, ...]
    client: tuple[int, ...]

    def record(self) -> dict[str, Any]:
        return {"pinned": True, "server_cpus": list(self.server), "client_cpus": list(self.client)}


def parse_cpus(text: str) -> tuple[int, ...]:
    """`0`, `0-3`, `0,2,4-5` -> sorted CPU numbers."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi if dash else lo)
        except ValueError as exc:
            raise ValueError(f"CPU list {text!r}: expected e.g. 0 or 0-3 or 0,2,4-5") from exc
        if first < 0 or last < first:
            raise ValueError(f"CPU list {text!r}: bad range {part!r}")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def split_cpus(
    available: Iterable[int], server: Iterable[int] | None = None, client: Iterable[int] | None = None
) -> CpuSplit | None:
    """The server's and the client's CPUs among `available` (None: one CPU, nothing to split). Defaults: the
    server the first half, rounded up, the client the rest; one side given, the other the remaining CPUs."""
    cpus = sorted(set(available))
    if server is None and client is None:
        if len(cpus) < 2:
            return None
        half = (len(cpus) + 1) // 2
        return CpuSplit(tuple(cpus[:half]), tuple(cpus[half:]))
    s = sorted(set(server)) if server is not None else [c for c in cpus if c not in set(client or ())]
    c = sorted(set(client)) if client is not None else [x for x in cpus if x not in set(s)]
    _check_split(cpus, s, c)
    return CpuSplit(tuple(s), tuple(c))


def _check_split(available: list[int], server: list[int], client: list[int]) -> None:
    outside = sorted(set(server + client) - set(available))
    if outside:
        raise ValueError(f"--server-cpus/--client-cpus: CPUs {outside} are not among the usable {available}")
    if not server or not client:
        raise ValueError(f"--server-cpus/--client-cpus: each side needs a CPU (usable: {available})")
    if set(server) & set(client):
        raise ValueError(f"--server-cpus/--client-cpus: CPUs {sorted(set(server) & set(client))} on both")


def usable_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on (its affinity mask)."""
    return tuple(sorted(os.sched_getaffinity(0)))


def pin_threads(tids: Iterable[int], cpus: Iterable[int]) -> tuple[dict[int, set[int]], list[str]]:
    """Pins each thread; returns each pinned thread's mask from before, and what could not be pinned."""
    before: dict[int, set[int]] = {}
    errors: list[str] = []
    for tid in tids:
        try:
            mask = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, set(cpus))
            before[tid] = mask
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        except OSError as exc:
            errors.append(f"thread {tid}: {exc.strerror or exc}")
    return before, errors


def restore(masks: Mapping[int, set[int]]) -> None:
    for tid, mask in masks.items():
        try:
            os.sched_setaffinity(tid, mask)
        except OSError:  # ended, or no longer ours to set
            continue


def tree_threads(pid: int) -> list[int]:
    return [tid for p in tree(pid) for tid in threads(p)]


@contextmanager
def pinned(split: CpuSplit | None, server_pids: Mapping[str, int], reason: str) -> Iterator[dict[str, Any]]:
    """The bench's threads on the client CPUs and the server processes' on the server CPUs for the block;
    yields what was done (for the report). `reason`: why nothing is pinned when `split` is None."""
    if split is None:
        yield {"pinned": False, "reason": reason}
        return
    own, errors = pin_threads(threads(os.getpid()), split.client)
    server: dict[int, set[int]] = {}
    for role, pid in server_pids.items():
        masks, failed = pin_threads(tree_threads(pid), split.server)
        server.update(masks)
        errors += [f"{role} (pid {pid}) {e}" for e in failed]
        if not masks and not failed:
            errors.append(f"{role} (pid {pid}): no such process")
    record = {**split.record(), "server_pids": dict(server_pids), "errors": errors}
    if not server_pids:
        record["server_note"] = "server not pinned by the bench (no --server-pid): pin it at start (taskset)"
    try:
        yield record
    finally:
        restore(own)
        restore(server)
