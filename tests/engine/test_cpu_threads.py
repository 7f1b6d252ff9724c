"""Choosing torch's intra-op thread count on CPU: the choice logic runs on injected timings (no assertion
on real speed), the CPU budget on fake affinity masks and cgroup files."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from conveyor.engine.cpu_threads import (
    DEFAULT_HIDDEN,
    ROUNDS,
    CpuBudget,
    candidate_counts,
    cgroup_cpu_quota,
    choose_cpu_threads,
    cpu_budget,
    decode_matmul_timer,
    hidden_size_of,
    parse_cpu_max,
    pick,
)


@pytest.fixture(autouse=True)
def torch_threads_kept() -> Iterator[int]:
    """Every test leaves torch's thread count as it found it, whatever the code under test does."""
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def fake_timings(ms_by_threads: dict[int, float], seen: list[int]) -> Callable[[], float]:
    """A measure() that answers by torch's current thread count, so it also sees what the chooser set."""
    def measure() -> float:
        seen.append(torch.get_num_threads())
        return ms_by_threads[torch.get_num_threads()]

    return measure


def test_fewer_threads_are_kept_when_more_are_not_clearly_faster() -> None:
    seen: list[int] = []
    choice = choose_cpu_threads(512, budget=CpuBudget(4, None),
                                measure=fake_timings({1: 10.0, 2: 9.5, 4: 9.2}, seen))
    assert seen == [1, 2, 4] * ROUNDS  # in turns: a burst of other work hits every count alike
    assert choice.threads == 1  # 9.2 ms is within 10% of 10.0: noise must not buy a thread
    assert "within 10%" in choice.reason and choice.timings_ms == {1: 10.0, 2: 9.5, 4: 9.2}


def test_more_threads_are_chosen_when_clearly_faster() -> None:
    timings = {1: 10.0, 2: 5.0, 4: 2.0}
    choice = choose_cpu_threads(512, budget=CpuBudget(4, None), measure=fake_timings(timings, []))
    assert (choice.threads, choice.reason) == (4, "fastest")
    # Among the clearly faster counts, still the fewest within the margin of the fastest:
    assert pick({1: 10.0, 2: 5.0, 4: 4.8}) == (2, "within 10% of the fastest (4 threads), fewer threads")


def test_stalls_count_in_full_the_mean_of_the_rounds_decides() -> None:
    # Two threads win two rounds of three, but one stalled round (the other vCPU was busy) costs more than
    # they gained: a step waits for its slowest thread, so the mean decides, not the median.
    rounds = iter([1.0, 0.5, 1.0, 0.5, 1.0, 8.0])

    def measure() -> float:
        return next(rounds)

    choice = choose_cpu_threads(512, budget=CpuBudget(2, None), measure=measure)
    assert choice.threads == 1 and choice.timings_ms == {1: 1.0, 2: 3.0}


def test_slower_extra_threads_lose_as_on_a_shared_two_vcpu_machine() -> None:
    choice = choose_cpu_threads(512, budget=CpuBudget(2, None), measure=fake_timings({1: 3.1, 2: 5.4}, []))
    assert choice.threads == 1 and choice.reason == "fastest"
    assert choice.describe() == "1 of 2 CPUs (1: 3.10 ms, 2: 5.40 ms per step-sized matmul; fastest)"


def test_torch_thread_count_is_restored_after_measuring_even_on_error(torch_threads_kept: int) -> None:
    torch.set_num_threads(3)
    choose_cpu_threads(64, budget=CpuBudget(2, None), measure=fake_timings({1: 1.0, 2: 2.0}, []))
    assert torch.get_num_threads() == 3  # the caller applies the choice; measuring changes nothing

    def broken() -> float:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        choose_cpu_threads(64, budget=CpuBudget(2, None), measure=broken)
    assert torch.get_num_threads() == 3


def test_candidates_never_exceed_the_affinity_mask_or_the_cgroup_quota() -> None:
    seen: list[int] = []
    timings = {n: 1.0 for n in range(1, 9)}
    choose_cpu_threads(512, [1, 2, 4, 8], budget=CpuBudget(2, None), measure=fake_timings(timings, seen))
    assert set(seen) == {1, 2}
    seen.clear()
    # A container limited to 3 CPUs on an 8-CPU host: 1, 2 and 3, never 4 or 8.
    choice = choose_cpu_threads(512, budget=CpuBudget(8, 3.0), measure=fake_timings(timings, seen))
    assert set(seen) == {1, 2, 3} and choice.available_cpus == 3
    assert (choice.affinity_cpus, choice.cgroup_quota) == (8, 3.0)


def test_one_usable_cpu_means_one_thread_without_measuring() -> None:
    def must_not_run() -> float:
        raise AssertionError("nothing to compare: no measurement")

    choice = choose_cpu_threads(512, budget=CpuBudget(64, 1.5), measure=must_not_run)
    assert (choice.threads, choice.reason, choice.timings_ms) == (1, "one CPU available", {})


def test_candidate_counts_are_powers_of_two_and_the_available_count() -> None:
    assert candidate_counts(1) == [1]
    assert candidate_counts(2) == [1, 2]
    assert candidate_counts(6) == [1, 2, 4, 6]
    assert candidate_counts(8) == [1, 2, 4, 8]


def test_cgroup_v2_cpu_max_is_parsed_including_max() -> None:
    assert parse_cpu_max("max 100000\n") is None
    assert parse_cpu_max("200000 100000\n") == 2.0
    assert parse_cpu_max("150000 100000") == 1.5
    # A fractional quota rounds down (a throttled thread stalls every op), never below one CPU:
    assert CpuBudget(64, 1.5).available == 1
    assert CpuBudget(64, 0.5).available == 1
    assert CpuBudget(64, 2.0).available == 2
    assert CpuBudget(2, 8.0).available == 2  # the affinity mask is the tighter limit
    assert CpuBudget(4, None).available == 4


def test_cgroup_quota_is_read_from_v2_then_v1_files(tmp_path: Path) -> None:
    assert cgroup_cpu_quota(tmp_path) is None  # neither: no quota
    v1 = tmp_path / "cpu"
    v1.mkdir()
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(tmp_path) is None
    (v1 / "cpu.cfs_quota_us").write_text("250000\n")
    assert cgroup_cpu_quota(tmp_path) == 2.5
    (tmp_path / "cpu.max").write_text("200000 100000\n")
    assert cgroup_cpu_quota(tmp_path) == 2.0
    (tmp_path / "cpu.max").write_text("garbage\n")
    assert cgroup_cpu_quota(tmp_path) is None


def test_cpu_budget_reads_the_affinity_mask_and_the_quota(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5}, raising=False)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_budget(tmp_path) == CpuBudget(affinity_cpus=2, cgroup_quota=None)
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    assert cpu_budget(tmp_path).available == 1


def test_hidden_size_comes_from_the_model_config(tmp_path: Path) -> None:
    assert hidden_size_of(str(tmp_path)) == DEFAULT_HIDDEN  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 896}))
    assert hidden_size_of(str(tmp_path)) == 896
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 2560}}))
    assert hidden_size_of(str(tmp_path)) == 2560


def test_the_real_timer_times_a_small_matmul_without_touching_the_global_rng() -> None:
    rng = torch.get_rng_state()
    ms = decode_matmul_timer(16, slice_s=0.001)()
    assert ms >= 0.0
    assert torch.equal(torch.get_rng_state(), rng)
