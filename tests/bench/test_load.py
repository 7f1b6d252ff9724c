"""`--load X`: the capacity is measured on the workload's own requests submitted at once, then each group
arrives at its share (its `--rate` weight, else the profile's mix) of X times that capacity, in every arm."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

import conveyor.bench.experiment as experiment_module
from conveyor.bench.cli import build_parser, main, options
from conveyor.bench.experiment import BenchOptions, apply_load, build_workload
from conveyor.bench.load import mix_weights, scaled_rates
from conveyor.bench.records import RequestRecord, RunResult
from conveyor.bench.workload import BenchRequest, Range, WorkloadSpec, generate

QUICK = ["--no-progress", "--no-matmul-bound"]


def parse(tmp_path: Path, *argv: str) -> BenchOptions:
    return options(build_parser().parse_args([*argv, "--out", str(tmp_path / "out")]))


# --- pure parts --------------------------------------------------------------------------------------


def test_scaled_rates_split_the_multiple_of_the_capacity_by_weight() -> None:
    rates = scaled_rates(60.0, 1.5, {"interactive": 3.0, "documents": 1.0})
    assert rates == pytest.approx({"interactive": 67.5, "documents": 22.5})
    assert scaled_rates(60.0, 0.5, {"interactive": 0.75, "documents": 0.25}) == pytest.approx(
        {"interactive": 22.5, "documents": 7.5}
    )
    assert scaled_rates(10.0, 2.0, {"only": 5.0}) == pytest.approx({"only": 20.0})
    assert scaled_rates(10.0, 1.0, {"a": 1.0, "b": 0.0}) == pytest.approx({"a": 10.0, "b": 0.0})


@pytest.mark.parametrize(
    ("capacity", "load", "weights", "match"),
    [
        (0.0, 1.5, {"a": 1.0}, "capacity"),
        (-3.0, 1.5, {"a": 1.0}, "capacity"),
        (math.nan, 1.5, {"a": 1.0}, "capacity"),
        (10.0, 0.0, {"a": 1.0}, "--load"),
        (10.0, -1.0, {"a": 1.0}, "--load"),
        (10.0, math.inf, {"a": 1.0}, "--load"),
        (10.0, 1.0, {"a": 0.0, "b": 0.0}, "weights"),
        (10.0, 1.0, {"a": -1.0, "b": 2.0}, "weights"),
        (10.0, 1.0, {}, "weights"),
    ],
)
def test_scaled_rates_reject_what_has_no_rate(
    capacity: float, load: float, weights: dict[str, float], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        scaled_rates(capacity, load, weights)


def test_the_weights_are_the_profiles_mix_or_the_rates_given() -> None:
    assert mix_weights(WorkloadSpec(profile="deadlines")) == pytest.approx(
        {"interactive": 0.75, "documents": 0.25}
    )
    mixed = WorkloadSpec(profile="mixed", documents_share=0.4, short_group="chat")
    assert mix_weights(mixed) == pytest.approx({"chat": 0.6, "documents": 0.4})
    assert mix_weights(WorkloadSpec(profile="short")) == {"interactive": 1.0}
    given = WorkloadSpec(profile="deadlines", rates={"interactive": 73.0, "documents": 24.0})
    assert mix_weights(given) == pytest.approx({"interactive": 73 / 97, "documents": 24 / 97})


def test_scaling_every_rate_by_one_factor_keeps_the_requests_and_scales_the_arrivals() -> None:
    # The calibration burst relies on it: the same draws, only the arrival times divided by the factor.
    def workload(rates: dict[str, float]) -> list[BenchRequest]:
        spec = WorkloadSpec(profile="deadlines", num_requests=30, seed=5, rates=rates,
                            long_prompt=Range(20, 40), long_output=Range(4, 8))
        return sorted(generate(spec, list(range(3, 200)), 128), key=lambda r: r.request_id)

    unit = workload({"interactive": 0.75, "documents": 0.25})
    fast = workload({"interactive": 30.0, "documents": 10.0})  # 40x
    assert [(r.group, r.prompt_token_ids, r.max_tokens) for r in unit] == [
        (r.group, r.prompt_token_ids, r.max_tokens) for r in fast
    ]
    assert [r.arrival_s / 40 for r in unit] == pytest.approx([r.arrival_s for r in fast], abs=1e-5)


# --- arguments ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--load", "0"], r"--load.*> 0"),
        (["--load", "-1.5"], r"--load.*> 0"),
        (["--load", "nan"], r"--load.*> 0"),
        (["--load", "1.5", "--target", "http"], r"--load.*--target engine"),
        (["--load", "1.5", "--rate", "interactive=3"], r"--rate.*weight.*missing documents"),
        (["--load", "1.5", "--rate", "interactive=3", "--rate", "documents=0"], r"not > 0: documents=0"),
    ],
)
def test_bad_load_arguments_are_refused(tmp_path: Path, argv: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse(tmp_path, "--profile", "deadlines", *argv)


def test_a_trace_takes_a_load_without_calibration_but_not_a_bad_one(tmp_path: Path) -> None:
    """A trace's --load divides its recorded arrivals (tests/bench/test_trace_replay.py); it must be > 0."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"group": "batch", "prompt": "x", "max_tokens": 2}) + "\n")
    assert parse(tmp_path, "--trace", str(trace), "--load", "1.5").load == 1.5
    with pytest.raises(ValueError, match=r"--load.*> 0"):
        parse(tmp_path, "--trace", str(trace), "--load", "0")


def test_a_bad_load_is_reported_before_any_run(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(llama_dir), "--profile", "deadlines", "--load", "0", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    printed = " ".join(capsys.readouterr().out.split())
    assert "--load" in printed and "> 0" in printed
    assert not (tmp_path / "o").exists()


# --- the calibration ---------------------------------------------------------------------------------


def test_the_capacity_is_completed_requests_per_second_of_the_burst(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stand-in target: every request completes, the burst lasts 4 s, so the capacity is exactly n / 4.
    seen: list[tuple[BenchOptions, list[BenchRequest]]] = []

    def fake_run(
        opts: BenchOptions, requests: list[BenchRequest], console: Console
    ) -> tuple[RunResult, Any]:
        seen.append((opts, requests))
        records = [
            RequestRecord(r.request_id, r.group, 100.0, r.max_tokens, status="completed") for r in requests
        ]
        return RunResult("engine", records, [], start_time=100.0, end_time=104.0), None

    monkeypatch.setattr(experiment_module, "run_target", fake_run)
    opts = parse(tmp_path, "--model", str(llama_dir), "--profile", "deadlines", "-n", "20", "--load", "2",
                 "--rate", "interactive=1", "--rate", "documents=3", "--set", "max_num_seqs=3")
    plan = apply_load(opts, Console(quiet=True))
    assert plan is not None and plan.capacity_rps == pytest.approx(5.0)
    assert plan.rates == pytest.approx({"interactive": 2.5, "documents": 7.5})  # 2 x 5/s, split 1:3
    assert opts.spec.rates == plan.rates and plan.offered_rps == pytest.approx(10.0)
    (calibrated, burst), = seen
    assert calibrated.engine["max_num_seqs"] == 3 and all(r.arrival_s == 0 for r in burst)
    measured, _ = build_workload(opts)  # the same requests, now arriving at the derived rates
    key = lambda r: r.request_id  # noqa: E731
    assert [(r.prompt_token_ids, r.max_tokens) for r in sorted(burst, key=key)] == [
        (r.prompt_token_ids, r.max_tokens) for r in sorted(measured, key=key)
    ]
    assert max(r.arrival_s for r in measured) == pytest.approx(plan.arrival_span_s, abs=1e-5)
    assert apply_load(opts, Console(quiet=True)) is plan and len(seen) == 1  # measured once


def test_compare_at_a_load_multiple_reports_the_capacity_and_the_rates(
    llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "cmp"
    argv = ["--model", str(llama_dir), "--profile", "deadlines", "-n", "12", "--seed", "0", "--load", "1.5"]
    argv += ["--set", "max_num_seqs=4", "--deadline", "interactive=0.5", "--deadline", "documents=30"]
    argv += ["--long-prompt", "40:80", "--long-output", "8:16", "--short-output", "4:8"]
    assert main([*argv, "--compare", "scheduling=arrival", *QUICK, "--out", str(out)]) == 0
    sheet = json.loads((out / "decision.json").read_text())
    load = sheet["input_set"]["load"]
    assert load["load"] == 1.5 and load["capacity_rps"] > 0 and load["calibration_requests"] == 12
    assert load["weights"] == pytest.approx({"interactive": 0.75, "documents": 0.25})
    rates = load["rates"]
    assert sum(rates.values()) == pytest.approx(1.5 * load["capacity_rps"])
    assert rates["interactive"] == pytest.approx(3 * rates["documents"])
    assert sheet["input_set"]["spec"]["rates"] == rates  # the arms ran at these rates
    for run in ("baseline", "candidate"):
        assert sheet[run]["all"]["submitted"] == 12  # the same trace for both arms
    trace = [json.loads(line) for line in (out / "trace.jsonl").read_text().splitlines()]
    assert max(r["arrival_s"] for r in trace) == pytest.approx(load["arrival_span_s"], abs=1e-5)
    text = (out / "decision.md").read_text()
    assert f"load 1.5x the measured capacity of {load['capacity_rps']:.4g} requests/s" in text
    assert f"interactive {rates['interactive']:.4g}/s" in text
    assert f"documents {rates['documents']:.4g}/s" in text
