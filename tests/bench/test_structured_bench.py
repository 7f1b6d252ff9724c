"""`--structured-share`: which requests are constrained, and the figures a compare run reports."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from conveyor.bench.cli import main
from conveyor.bench.experiment import BenchOptions, with_param
from conveyor.bench.metrics import full_batch_decode_steps
from conveyor.bench.records import StepSample
from conveyor.bench.report import run_line
from conveyor.bench.structured import BENCH_SCHEMA, constrained_ids
from conveyor.bench.workload import BenchRequest


def _requests(n: int) -> list[BenchRequest]:
    return [BenchRequest(f"r{i}", "interactive", 0.0, 4, prompt_token_ids=[1, 2]) for i in range(n)]


@pytest.mark.parametrize(
    ("share", "expected"), [(0.0, []), (0.5, [1, 3, 5]), (1 / 3, [2, 5]), (1.0, range(6))]
)
def test_the_constrained_requests_are_spread_evenly(share: float, expected: list[int]) -> None:
    assert constrained_ids(_requests(6), share) == {f"r{i}" for i in expected}


def test_the_bench_schema_is_a_valid_schema_of_the_kinds_users_ask_for() -> None:
    jsonschema.Draft202012Validator.check_schema(BENCH_SCHEMA)
    kinds = {json.dumps(p, sort_keys=True) for p in BENCH_SCHEMA["properties"].values()}
    assert any('"enum"' in k for k in kinds) and any('"maxItems"' in k for k in kinds)


@pytest.mark.parametrize("bad", ["-0.1", "1.5"])
def test_a_share_outside_zero_to_one_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="structured_share"):
        with_param(BenchOptions(model="m"), "structured_share", bad)


def test_only_the_in_process_engine_constrains() -> None:
    with pytest.raises(ValueError, match="structured_share"):
        BenchOptions(model="m", target="http", structured_share=0.5)


def test_decode_steps_are_compared_at_the_largest_pure_decode_batch() -> None:
    steps = [StepSample(0.0, {}, {}, num_tokens=n, num_seqs=s, step_s=t)
             for n, s, t in [(300, 4, 9.0), (4, 4, 0.04), (4, 4, 0.02), (3, 3, 0.01)]]
    figures = full_batch_decode_steps(steps)
    assert figures is not None
    assert (figures["batch"], figures["steps"]) == (4, 2) and figures["mean_s"] == pytest.approx(0.03)


def test_compare_constraining_half_the_batch(demo_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "so"
    args = ["--model", str(demo_model_dir), "--profile", "short", "-n", "8", "--short-prompt", "8:16",
            "--short-output", "6:6", "--set", "max_num_seqs=8", "--no-progress", "--no-matmul-bound",
            "--out", str(out), "--compare", "structured_share=0.5"]
    assert main(args) == 0
    sheet = json.loads((out / "decision.json").read_text())
    assert (sheet["baseline_value"], sheet["candidate_value"]) == (0.0, 0.5)
    assert sheet["baseline_run"]["structured"] is None
    split = sheet["candidate_run"]["structured"]
    assert split["constrained"]["submitted"] == split["unconstrained"]["submitted"] == 4
    assert split["constrained"]["completed"] + split["unconstrained"]["completed"] == 8
    assert sheet["candidate_run"]["decode_steps"]["batch"] == 8
    records = [json.loads(line) for line in (out / "structured_share=0.5" / "requests.jsonl").open()]
    trace = [json.loads(line)["request_id"] for line in (out / "trace.jsonl").open()]
    assert {r["request_id"] for r in records if r["constrained"]} == set(trace[1::2])
    line = run_line("candidate", sheet["candidate_run"])
    assert "decode step at batch 8" in line and "constrained 4/4" in line and "unconstrained 4/4" in line
