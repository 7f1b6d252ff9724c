"""The bench's torch thread count: --threads, else (in-process engine on CPU) the measured choice, which the
inventory records; main() gives the caller its thread count back."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from rich.console import Console

from conveyor.bench import cli
from conveyor.bench.cli import apply_threads, main
from conveyor.bench.experiment import BenchOptions
from conveyor.bench.inventory import inventory
from conveyor.engine.cpu_threads import ThreadChoice

CHOICE = ThreadChoice(1, "fastest", {1: 3.1, 2: 5.4}, 2, 2, None)


@pytest.fixture(autouse=True)
def threads_kept() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """Only what the thread choice reads: the hidden size (no weights are loaded by these tests)."""
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 96}))
    return tmp_path


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The hidden sizes the bench's chooser was called with; it answers CHOICE."""
    calls: list[int] = []

    def chooser(hidden: int) -> ThreadChoice:
        calls.append(hidden)
        return CHOICE

    monkeypatch.setattr(cli, "choose_cpu_threads", chooser)
    return calls


def test_without_threads_the_engine_run_uses_and_records_the_measured_choice(
    model_dir: Path, asked: list[int]
) -> None:
    torch.set_num_threads(2)
    opts = BenchOptions(model=str(model_dir), engine={"device": "cpu"})
    apply_threads(None, opts, Console(quiet=True))
    assert asked == [96]
    assert torch.get_num_threads() == 1 and opts.engine["num_threads"] == 1
    assert opts.thread_choice == CHOICE
    inv = inventory(None, {}, opts.thread_choice)
    assert inv["torch_threads"] == 1
    record = inv["cpu_threads"]
    assert record["choice"] == {"threads": 1, "reason": "fastest", "timings_ms": {"1": 3.1, "2": 5.4}}
    assert record["available_cpus"] >= 1 and record["affinity_cpus"] >= record["available_cpus"]
    assert "cgroup_quota_cpus" in record


def test_an_explicit_count_or_a_gpu_or_the_http_target_is_not_measured(
    model_dir: Path, asked: list[int]
) -> None:
    apply_threads(1, BenchOptions(model=str(model_dir)), Console(quiet=True))
    assert torch.get_num_threads() == 1
    given = BenchOptions(model=str(model_dir), engine={"num_threads": 2})
    apply_threads(None, given, Console(quiet=True))
    apply_threads(None, BenchOptions(model=str(model_dir), engine={"device": "cuda"}), Console(quiet=True))
    apply_threads(None, BenchOptions(model=str(model_dir), target="http"), Console(quiet=True))
    assert asked == [] and given.engine == {"num_threads": 2} and given.thread_choice is None
    assert inventory(None, {}, given.thread_choice)["cpu_threads"]["choice"] is None


def test_main_gives_back_the_thread_count(
    model_dir: Path, asked: list[int], tmp_path: Path
) -> None:
    torch.set_num_threads(2)
    # Fails after the threads are applied (the parameter is checked before any run): cheap, and main's
    # clean-up runs on that path as on every other.
    args = ["--model", str(model_dir), "--set", "device=cpu", "--compare", "no_such_param=3"]
    assert main([*args, "--out", str(tmp_path / "out")]) == 2
    assert asked == [96]
    assert torch.get_num_threads() == 2
