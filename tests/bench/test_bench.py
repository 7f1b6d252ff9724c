"""The bench end to end on the tiny model: reports, counts, cancellations, decision sheets, plots, traces,
the HF peers, and the pure parts (workloads, metrics, approval conditions)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from conveyor.bench.cli import main
from conveyor.bench.decision import Condition, decide
from conveyor.bench.metrics import LATENCIES, PERCENTILES, summarize
from conveyor.bench.records import RequestRecord, RunResult, StepSample
from conveyor.bench.trace_replay import load_trace
from conveyor.bench.workload import Range, WorkloadSpec, generate
from conveyor.kernels.paged_attention import resolve_backend

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
GROUP_METRICS = (
    "submitted",
    "completed",
    "cancelled",
    "failed",
    "queue_time_s",
    "ttft_s",
    "itl_s",
    "e2e_s",
    "deadline_s",
    "deadline_attainment",
    "output_tokens_per_s",
    "total_tokens_per_s",
    "preemptions",
    "peak_kv_usage",
    "kv_waste",
    "kv_waste_peak",
    "peak_running",
)
# Small and quick: a handful of requests, a few tokens each.
SMALL = [
    "-n",
    "10",
    "--short-prompt",
    "4:24",
    "--short-output",
    "2:6",
    "--long-prompt",
    "40:120",
    "--long-output",
    "4:8",
    "--documents-share",
    "0.3",
    "--set",
    "max_num_seqs=4",
    "--no-progress",
    "--no-matmul-bound",
]


def run_cli(args: list[str]) -> None:
    assert main(args) == 0


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    with Image.open(path) as img:
        img.verify()


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def test_offline_bench_reports_every_metric_and_counts_cancellations(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run_cli(
        [
            "--model",
            str(llama_dir),
            *SMALL,
            "--cancel-share",
            "0.4",
            "--rate",
            "interactive=50",
            "--out",
            str(out),
        ]
    )
    report = load(out / "report.json")
    metrics = report["runs"]["engine"]["metrics"]
    assert set(metrics) == {"interactive", "documents", "all"}
    for group, m in metrics.items():
        assert set(GROUP_METRICS) <= set(m), group
        assert m["completed"] + m["cancelled"] + m["failed"] == m["submitted"]
        for name in LATENCIES:
            assert set(m[f"{name}_s"]) == {f"p{p}" for p in PERCENTILES}
    assert metrics["all"]["submitted"] == 10 and metrics["all"]["failed"] == 0
    trace = [json.loads(line) for line in (out / "trace.jsonl").read_text().splitlines()]
    # The bench cancels at half of max_tokens: every request marked so ends cancelled, the rest complete.
    expected_cancelled = sum("cancel_after_tokens" in r for r in trace)
    assert expected_cancelled > 0
    assert metrics["all"]["cancelled"] == expected_cancelled
    assert metrics["all"]["completed"] == 10 - expected_cancelled
    assert metrics["all"]["output_tokens"] == sum(
        r["max_tokens"] for r in trace if "cancel_after_tokens" not in r
    )
    assert 0 < metrics["all"]["peak_kv_usage"] <= 1 and 0 <= metrics["all"]["kv_waste"] < 1
    assert 1 <= metrics["all"]["peak_running"] <= 4
    eff = report["runs"]["engine"]["efficiency"]
    assert eff["model_flops"] > 0 and eff["overhead_share_all_steps"] is not None
    inv = report["inventory"]
    assert inv["model"]["config_sha256"] and inv["torch_version"] and inv["git_commit"] is not None
    assert inv["parameters"]["engine"]["max_num_seqs"] == 4
    assert inv["parameters"]["attention_backend"] == resolve_backend(None, torch.device("cpu"))
    assert [c["name"] for c in inv["parameters"]["engine"]["request_classes"]] == ["interactive", "documents"]
    for name in ("latency_cdf.png", "timeline.png"):
        assert_png(out / name)
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert sorted(r["request_id"] for r in rows) == sorted(r["request_id"] for r in trace)
    steps = (out / "steps.jsonl").read_text().splitlines()
    assert len(steps) == len([s for s in steps if json.loads(s)["kv_total_blocks"]]) > 0
    assert "| interactive |" in (out / "report.md").read_text()


def test_a_quantization_is_set_and_compared_and_each_run_says_its_weights(tiny_model_dir, tmp_path: Path,
                                                                        ) -> None:
    model = tiny_model_dir("LlamaForCausalLM", hidden_size=128, intermediate_size=256)  # widths of 32s
    out = tmp_path / "quant"
    run_cli(["--model", str(model), *SMALL, "--out", str(out), "--set", "quantization=int4", "--compare",
             "quantization=none"])
    sheet = load(out / "decision.json")
    assert (sheet["baseline_value"], sheet["candidate_value"]) == ("int4", None)  # None: "none"
    baseline, candidate = sheet["baseline_run"]["weights"], sheet["candidate_run"]["weights"]
    assert (baseline["held_as"], candidate["held_as"]) == ("int4", "float32")
    assert baseline["bytes"] < 0.3 * candidate["bytes"]
    assert "(int4)" in (out / "decision.md").read_text()


def test_compare_writes_a_decision_sheet(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    run_cli(
        [
            "--model",
            str(llama_dir),
            *SMALL,
            "--out",
            str(out),
            "--compare",
            "max_num_seqs=2",
            "--approve",
            "all.completed>=baseline",
            "--approve",
            "all.output_tokens>=baseline*100",
            "--hypothesis",
            "two sequences at a time is enough",
            "--repeat",
            "2",
        ]
    )
    sheet = load(out / "decision.json")
    assert sheet["parameter"] == "max_num_seqs"
    assert (sheet["baseline_value"], sheet["candidate_value"]) == (4, 2)
    assert sheet["hypothesis"] == "two sequences at a time is enough"
    assert sheet["input_set"]["num_requests"] == 10 and len(sheet["input_set"]["trace_sha256"]) == 64
    checks = {c["condition"]: c["passed"] for c in sheet["decision"]["checks"]}
    assert checks == {"all.completed>=baseline": True, "all.output_tokens>=baseline*100": False}
    assert sheet["decision"]["approved"] is False
    assert sheet["candidate"]["all"]["peak_running"] <= 2 < sheet["baseline"]["all"]["peak_running"] + 1
    assert sheet["inventory"]["parameters"]["candidate"]["engine"]["max_num_seqs"] == 2
    for run in ("baseline_run", "candidate_run"):
        assert len(sheet[run]["rounds_output_tokens_per_s"]) == 2
    assert "REJECTED" in (out / "decision.md").read_text()
    assert_png(out / "baseline" / "latency_cdf.png")


def test_sweep_writes_a_sheet_per_value_and_a_plot(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    run_cli(
        [
            "--model",
            str(llama_dir),
            *SMALL,
            "-n",
            "4",
            "--out",
            str(out),
            "--sweep",
            "interactive.max_running=1,2",
            "--approve",
            "all.failed<=0",
        ]
    )
    for value in ("1", "2"):
        sheet = load(out / f"decision-interactive.max_running={value}.json")
        assert sheet["decision"]["approved"] is True
        assert sheet["candidate"]["interactive"]["peak_running"] <= int(value)
    sweep = load(out / "sweep.json")
    assert sweep["values"] == [4, 1, 2] and sweep["approved"] == [True, True]
    assert_png(out / "sweep.png")


def test_trace_replay_with_text_prompts_and_lengths(llama_dir: Path, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"arrival_s": 0.0, "group": "interactive", "prompt": "Good morning! How are you?", "max_tokens": 3},
        {"arrival_s": 0.05, "group": "documents", "prompt_tokens": 60, "max_tokens": 4},
        {
            "arrival_s": 0.1,
            "group": "interactive",
            "prompt_token_ids": [5, 6, 7],
            "max_tokens": 2,
            "cancel_after_tokens": 1,
        },
    ]
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "replay"
    run_cli(
        [
            "--model",
            str(llama_dir),
            "--trace",
            str(trace),
            "--no-progress",
            "--no-matmul-bound",
            "--out",
            str(out),
        ]
    )
    metrics = load(out / "report.json")["runs"]["engine"]["metrics"]
    assert (metrics["interactive"]["submitted"], metrics["documents"]["submitted"]) == (2, 1)
    assert metrics["interactive"]["cancelled"] == 1 and metrics["all"]["completed"] == 2
    assert metrics["documents"]["prompt_tokens"] == 60 and metrics["documents"]["output_tokens"] == 4


def test_peer_hf_runs_the_same_work(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "peer"
    run_cli(
        ["--model", str(llama_dir), *SMALL, "-n", "6", "--out", str(out), "--peer", "hf", "--repeat", "2"]
    )
    report = load(out / "report.json")
    assert set(report["runs"]) == {"engine", "hf-static", "hf-cb"}
    useful = {name: run["metrics"]["all"]["output_tokens"] for name, run in report["runs"].items()}
    assert len(set(useful.values())) == 1, useful  # EOS ignored everywhere: identical work
    assert set(report["ratios"]) == {"engine / hf-static", "engine / hf-cb", "engine / best HF mode"}
    assert all(r > 0 for r in report["ratios"].values())
    assert_png(out / "hf-cb-latency_cdf.png")
    for run in report["runs"].values():  # two interleaved rounds each; the best one is reported
        rounds = run["rounds_output_tokens_per_s"]
        assert len(rounds) == 2 and run["metrics"]["all"]["output_tokens_per_s"] == pytest.approx(max(rounds))


def test_an_moe_model_against_transformers_with_its_expert_load(tiny_model_dir, tmp_path: Path) -> None:
    out = tmp_path / "moe"
    mixtral = tiny_model_dir("MixtralForCausalLM")
    run_cli(["--model", str(mixtral), *SMALL, "-n", "4", "--out", str(out), "--peer", "hf"])
    report = load(out / "report.json")
    useful = {name: run["metrics"]["all"]["output_tokens"] for name, run in report["runs"].items()}
    assert len(set(useful.values())) == 1, useful
    engine = report["runs"]["engine"]
    experts = engine["expert_tokens"]
    # Every computed token goes to 2 of the 4 experts in each of the 2 layers.
    metrics = engine["metrics"]["all"]
    computed = metrics["prompt_tokens"] + metrics["output_tokens"] - metrics["completed"]
    assert len(experts) == 4 and sum(experts) == computed * 2 * 2
    assert "4 experts, tokens per expert" in (out / "report.md").read_text()
    assert report["runs"]["hf-cb"]["expert_tokens"] is None


def test_bad_arguments_are_reported_not_raised(llama_dir: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(llama_dir), "--compare", "no_such_param=3", "--out", str(tmp_path)]) == 2
    assert main(["--model", str(llama_dir), "--peer", "llama.cpp", "--out", str(tmp_path)]) == 2
    assert "--peer llama.cpp runs GGUF files" in capsys.readouterr().out
    assert main(["--model", str(llama_dir), "--rate", "batch=2", "--out", str(tmp_path)]) == 2


# --- pure parts --------------------------------------------------------------------------------------


def test_workloads_are_seeded_and_respect_their_ranges() -> None:
    spec = WorkloadSpec(
        profile="mixed",
        num_requests=40,
        seed=3,
        documents_share=0.25,
        cancel_share=0.5,
        rates={"interactive": 5.0},
        short_prompt=Range(4, 8),
        short_output=Range(2, 3),
        long_prompt=Range(50, 60),
        long_output=Range(10, 12),
    )
    vocab = list(range(3, 100))
    a, b = generate(spec, vocab, 128), generate(spec, vocab, 128)
    assert a == b
    assert a != generate(WorkloadSpec(**{**spec.__dict__, "seed": 4}), vocab, 128)
    docs = [r for r in a if r.group == "documents"]
    chats = [r for r in a if r.group == "interactive"]
    assert len(docs) == 10 and len(chats) == 30
    assert all(50 <= len(r.prompt_token_ids or []) <= 60 and 10 <= r.max_tokens <= 12 for r in docs)
    assert all(4 <= len(r.prompt_token_ids or []) <= 8 and 2 <= r.max_tokens <= 3 for r in chats)
    assert all(r.arrival_s == 0 for r in docs) and len({r.arrival_s for r in chats}) == 30  # Poisson
    assert 0 < sum(r.cancel_after_tokens is not None for r in a) < 40
    long_only = generate(WorkloadSpec(profile="long", num_requests=5, long_output=Range(8, 8)), vocab, 64)
    assert all(len(r.prompt_token_ids or []) + r.max_tokens <= 64 for r in long_only)


def test_trace_rejects_a_malformed_group(tmp_path: Path) -> None:
    # A trace may name any queue (`batch` loads); a name that cannot be one, or `all`, is rejected.
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"group": "batch", "prompt": "x", "max_tokens": 2}\n')
    assert [r.group for r in load_trace(trace, [3, 4])] == ["batch"]
    for group in ("all", "two words", "a.b", ""):
        trace.write_text(json.dumps({"group": group, "prompt": "x", "max_tokens": 2}) + "\n")
        with pytest.raises(ValueError, match="group"):
            load_trace(trace, [3, 4])


def _record(rid: str, group: str, status: str, e2e: float, out: int = 4) -> RequestRecord:
    return RequestRecord(
        request_id=rid,
        group=group,
        arrival_time=100.0,
        max_tokens=out,
        prompt_tokens=10,
        output_tokens=out,
        status=status,
        first_scheduled_time=100.5,  # type: ignore[arg-type]
        first_token_time=101.0,
        finished_time=100.0 + e2e,
        num_preemptions=1,
    )


def test_metrics_follow_the_counting_rule() -> None:
    records = [
        _record("a", "interactive", "completed", 2.0),
        _record("b", "interactive", "completed", 4.0),
        _record("c", "interactive", "cancelled", 1.5, out=2),
        _record("d", "interactive", "failed", 9.0, out=0),
        _record("e", "documents", "completed", 10.0),
    ]
    samples = [
        StepSample(
            t=1.0,
            waiting={},
            running={"interactive": 2, "documents": 1},
            kv_used_blocks=4,
            kv_total_blocks=10,
            kv_block_size=16,
            kv_allocated_slots={"interactive": 32, "documents": 32},
            kv_stored_tokens={"interactive": 24, "documents": 32},
        )
    ]
    result = RunResult("engine", records, samples, start_time=100.0, end_time=110.0)
    m = summarize(result, {"interactive": 3.0, "documents": 60.0})
    inter = m["interactive"]
    assert (inter["submitted"], inter["completed"], inter["cancelled"], inter["failed"]) == (4, 2, 1, 1)
    assert inter["e2e_s"]["p50"] == pytest.approx(3.0)  # completed only: 2 s and 4 s
    assert inter["queue_time_s"]["p90"] == pytest.approx(0.5)
    assert inter["itl_s"]["p50"] == pytest.approx(2 / 3)  # (e2e - 1 s to first token) / 3 gaps: 1/3, 1
    assert inter["deadline_attainment"] == pytest.approx(1 / 3)  # a: in time, b: late, d: failed; c excluded
    assert inter["output_tokens"] == 8 and inter["output_tokens_per_s"] == pytest.approx(0.8)
    assert inter["preemptions"] == 4
    assert inter["kv_waste"] == pytest.approx(0.25) and m["documents"]["kv_waste"] == 0
    assert m["all"]["kv_waste"] == pytest.approx(8 / 64) and m["all"]["peak_kv_usage"] == pytest.approx(0.4)
    assert m["interactive"]["peak_kv_usage"] == pytest.approx(32 / 160)
    assert m["all"]["deadline_attainment"] == pytest.approx(2 / 4)
    assert m["all"]["peak_running"] == 3


def test_approval_conditions() -> None:
    base = {"all": {"completed": 10, "ttft_s": {"p90": 2.0}}}
    cand = {"all": {"completed": 9, "ttft_s": {"p90": 0.8}}}
    result = decide(
        [Condition.parse("all.ttft_p90 <= 1.0"), Condition.parse("all.completed>=baseline")], cand, base
    )
    assert [c["passed"] for c in result["checks"]] == [True, False] and result["approved"] is False
    assert Condition.parse("all.ttft_p90<=baseline*0.5").evaluate(cand, base)["threshold"] == pytest.approx(
        1.0
    )
    missing = Condition.parse("documents.completed>=1").evaluate(cand, base)
    assert missing["passed"] is False and missing["note"] == "figure missing"
    with pytest.raises(ValueError, match="approve"):
        Condition.parse("ttft below one second")
    with pytest.raises(ValueError, match="percentile"):
        Condition.parse("all.ttft_p75<=1").evaluate(cand, base)
    with pytest.raises(ValueError, match="unknown metric"):
        Condition.parse("all.speed>=1").evaluate(cand, base)


def test_matmul_bound_weights_each_step_by_its_own_shape() -> None:
    from conveyor.bench.roofline import ModelShape, matmul_bound, step_linear_flops

    shape = ModelShape(hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, intermediate=64, vocab=300)
    samples = [
        StepSample(t=0.0, waiting={}, running={}, num_tokens=n, num_seqs=min(n, 4)) for n in (3, 4, 100)
    ]
    bound = matmul_bound(shape, samples, seconds_per_bucket=0.02)
    assert bound is not None
    assert [(b["tokens"], b["steps"]) for b in bound.buckets] == [(4, 2), (128, 1)]
    rates = {b["tokens"]: b["flops_per_s"] for b in bound.buckets}
    flops = [step_linear_flops(shape, s.num_tokens, s.num_seqs) for s in samples]
    ideal = flops[0] / rates[4] + flops[1] / rates[4] + flops[2] / rates[128]
    assert bound.flops_per_s == pytest.approx(sum(flops) / ideal)
    assert matmul_bound(shape, []) is None
