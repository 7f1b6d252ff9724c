"""The service bench's server-side figures as pure functions: a process tree's CPU time between two samples,
per completed job and per core (bench/server_cpu.py); the CPUs split between the server and the bench
(bench/affinity.py); /proc read as Linux writes it (bench/procfs.py); and pinning done and undone."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conveyor.bench.affinity import CpuSplit, parse_cpus, pinned, split_cpus, tree_threads
from conveyor.bench.cli import main, server_pids
from conveyor.bench.procfs import ProcTimes, descendants, parents, read_times, tree
from conveyor.bench.report import pinning_text, server_cpu_markdown
from conveyor.bench.server_cpu import CpuWindow, cpu_figures, server_figures, tree_cpu_s

ROOT, CHILD, LATE = (100, 5), (101, 7), (102, 900)


def test_a_tree_counts_each_process_since_the_first_sample_and_children_it_waited_for() -> None:
    before = {ROOT: ProcTimes(2.0, 1.0), CHILD: ProcTimes(0.5, 0.25)}
    after = {ROOT: ProcTimes(5.0, 1.5), CHILD: ProcTimes(1.5, 0.25), LATE: ProcTimes(0.2, 0.05)}
    # root 3.5 + child 1.0 + a process started in the window, all of it: 0.25.
    assert tree_cpu_s(before, after) == pytest.approx(4.75)
    # The child ended and the root waited for it: its whole life (0.75 before, 1.0 since) is now in the root's
    # children's times; only the window's share counts.
    reaped = {ROOT: ProcTimes(5.0, 1.5, children_user=1.5, children_system=0.25)}
    assert tree_cpu_s(before, reaped) == pytest.approx(3.5 + 1.0)
    assert tree_cpu_s(before, before) == 0.0
    assert tree_cpu_s(before, {}) == 0.0  # never below zero


def test_a_pid_used_again_is_another_process() -> None:
    before = {(100, 5): ProcTimes(9.0, 1.0)}
    after = {(100, 77): ProcTimes(0.3, 0.1)}  # same pid, later start: the old one ended unseen
    assert tree_cpu_s(before, after) == 0.0  # 0.4 new, 10 gone (taken back): clamped


def test_cpu_per_completed_job_and_per_core() -> None:
    figures = cpu_figures(cpu_s=8.4, wall_s=12.0, completed=600)
    assert figures["cpu_ms_per_job"] == pytest.approx(14.0)
    assert figures["cores_used"] == pytest.approx(0.7)
    # jobs/s (50) over the cores used (0.7) = jobs per CPU second.
    assert figures["jobs_per_s_per_core"] == pytest.approx(600 / 12.0 / 0.7)
    assert cpu_figures(None, 12.0, 600) == dict.fromkeys(figures)
    assert cpu_figures(0.0, 12.0, 0)["cpu_ms_per_job"] is None


def test_server_figures_per_role_with_a_total_and_unknowns() -> None:
    measured = {
        "window_s": 10.0,
        "roles": {
            "api": {"pid": 1, "cpu_s": 4.0, "note": None, "processes": 1},
            "worker": {"pid": 2, "cpu_s": 6.0, "note": None, "processes": 1},
        },
    }
    out = server_figures(measured, completed=500)
    assert [out["roles"][r]["cpu_ms_per_job"] for r in ("api", "worker", "total")] == [8.0, 12.0, 20.0]
    assert out["roles"]["total"]["jobs_per_s_per_core"] == pytest.approx(50.0)
    assert out["unknown"] is None
    measured["roles"]["worker"] |= {"cpu_s": None, "note": "process 2 not found after the run"}
    out = server_figures(measured, completed=500)
    assert out["roles"]["total"]["cpu_s"] is None and out["unknown"] == "process 2 not found after the run"
    none = server_figures(None, completed=5)
    assert none["roles"] == {} and "--server-pid" in none["unknown"]
    assert any("server CPU unknown" in line for line in server_cpu_markdown({"server_cpu": none}))


def test_the_server_gets_the_first_half_and_the_bench_the_rest() -> None:
    assert split_cpus([0, 1]) == CpuSplit((0,), (1,))
    assert split_cpus([3, 2, 1, 0]) == CpuSplit((0, 1), (2, 3))
    assert split_cpus([0, 1, 2]) == CpuSplit((0, 1), (2,))
    assert split_cpus([4]) is None  # one CPU: nothing to split
    assert split_cpus([0, 1, 2, 3], server=[3]) == CpuSplit((3,), (0, 1, 2))
    assert split_cpus([0, 1, 2, 3], client=[0]) == CpuSplit((1, 2, 3), (0,))
    assert split_cpus([0, 1, 2, 3], server=[0], client=[2]) == CpuSplit((0,), (2,))


@pytest.mark.parametrize(
    ("server", "client", "message"),
    [([1], [1], "on both"), ([5], None, "not among"), ([0, 1], None, "each side"), ([0], [], "each side")],
)
def test_a_bad_split_is_refused(server: list[int], client: list[int] | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_cpus([0, 1], server=server, client=client)


def test_cpu_lists_and_server_pids_parse() -> None:
    assert parse_cpus("0") == (0,) and parse_cpus("2-4,0") == (0, 2, 3, 4)
    for bad in ("", "a", "3-1", "-1"):
        with pytest.raises(ValueError):
            parse_cpus(bad)
    assert server_pids(["api=12", "worker=34"]) == {"api": 12, "worker": 34}
    assert server_pids(["56"]) == {"server": 56}
    for bad in (["api=x"], ["=3"], ["api=1", "api=2"]):
        with pytest.raises(ValueError):
            server_pids(bad)


def test_proc_stat_is_read_past_a_command_name_with_spaces_and_parentheses(tmp_path: Path) -> None:
    def stat(pid: int, ppid: int, comm: str = "python") -> None:
        (tmp_path / str(pid)).mkdir()
        fields = ["S", str(ppid), *["0"] * 9, "250", "50", "100", "20", *["0"] * 4, "12345", "0"]
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({comm}) " + " ".join(fields) + "\n")

    stat(10, 1, comm="a) (b")
    stat(11, 10)
    stat(12, 11)
    stat(13, 1)
    (tmp_path / "self").mkdir()  # not a process directory
    key, times = read_times(10, tmp_path)
    tick = os.sysconf("SC_CLK_TCK")
    assert key == (10, 12345)
    assert times == ProcTimes(250 / tick, 50 / tick, 100 / tick, 20 / tick)
    assert sorted(descendants(10, parents(tmp_path))) == [11, 12]


def test_pinning_moves_the_bench_and_the_server_tree_apart_and_back() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        with pinned(None, {}, "one CPU") as record:
            assert record == {"pinned": False, "reason": "one CPU"}
        return
    split = split_cpus(cpus)
    assert split is not None
    sleep = "import time; time.sleep(30)"
    code = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {sleep!r}]); {sleep}"
    server = subprocess.Popen([sys.executable, "-c", code])
    try:
        _wait_for_child(server.pid)
        before = {tid: os.sched_getaffinity(tid) for tid in tree_threads(server.pid)}
        with pinned(split, {"server": server.pid}, "") as record:
            assert record["errors"] == [] and record["server_pids"] == {"server": server.pid}
            assert os.sched_getaffinity(0) == set(split.client)
            assert {frozenset(os.sched_getaffinity(t)) for t in tree_threads(server.pid)} == {
                frozenset(split.server)
            }
            assert f"server on CPUs {list(split.server)}" in pinning_text(record)
        assert os.sched_getaffinity(0) == set(cpus)
        assert {tid: os.sched_getaffinity(tid) for tid in tree_threads(server.pid)} == before
        window = CpuWindow({"server": server.pid}).start()
        measured = window.stop()["roles"]["server"]
        assert measured["processes"] == 2 and measured["cpu_s"] is not None
    finally:
        for pid in tree(server.pid)[1:]:  # the child it started
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        server.kill()
        server.wait()


def test_a_server_pid_that_is_gone_is_unknown_not_zero() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    measured = CpuWindow({"api": proc.pid}).start().stop()["roles"]["api"]
    assert measured["cpu_s"] is None and "not found" in measured["note"]


def _wait_for_child(pid: int) -> None:
    deadline = time.monotonic() + 30
    while len(tree(pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(tree(pid)) == 2


def test_server_side_options_are_checked(tmp_path: Path) -> None:
    out = ["--out", str(tmp_path), "--no-progress"]
    http = ["--target", "http", "--profile", "service", *out]
    assert main(["--server-pid", "api=1", *out]) == 2  # the engine target
    assert main([*http, "--no-pin", "--server-cpus", "0"]) == 2
    assert main([*http, "--server-cpus", "0", "--client-cpus", "0"]) == 2
    assert main([*http, "--server-pid", "api"]) == 2  # not a pid
