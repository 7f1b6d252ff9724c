"""Speculative decoding in the bench: per-request drafted/accepted tokens from the engine's outputs, summed
per group with the acceptance rate, in the report, the decision sheet and its conditions; `--compare` with a
baseline value and several candidates; a text profile run end to end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conveyor.bench.cli import main
from conveyor.bench.decision import Condition
from conveyor.bench.experiment import BenchOptions, compare_arms, parse_value, with_param
from conveyor.bench.inventory import inventory
from conveyor.bench.metrics import summarize
from conveyor.bench.offline import run_engine
from conveyor.bench.records import RequestRecord, RunResult
from conveyor.bench.report import decision_markdown, report_markdown
from conveyor.bench.speculation import speculation_delta
from conveyor.bench.workload import BenchRequest, WorkloadSpec
from conveyor.engine.config import EngineConfig, RequestClassConfig
from conveyor.engine.llm_engine import LLMEngine


def record(rid: str, group: str, status: Any, drafted: int, accepted: int) -> RequestRecord:
    return RequestRecord(rid, group, arrival_time=100.0, max_tokens=8, output_tokens=8, status=status,
                         first_scheduled_time=100.1, first_token_time=100.2, finished_time=101.0,
                         drafted_tokens=drafted, accepted_tokens=accepted)


def summary() -> dict[str, dict[str, Any]]:
    records = [
        record("a", "documents", "completed", 10, 4),
        record("b", "documents", "cancelled", 6, 2),  # its drafts were verified all the same: counted
        record("c", "interactive", "completed", 0, 0),
    ]
    return summarize(RunResult("engine", records, [], start_time=100.0, end_time=102.0), {})


def run(metrics: dict[str, dict[str, Any]], speculation: dict[str, Any] | None) -> dict[str, Any]:
    return {"target": "engine", "duration_s": 2.0, "prefix_cache": None, "speculation": speculation,
            "metrics": metrics}


def test_groups_sum_their_requests_and_rate_acceptance() -> None:
    m = summary()
    assert (m["documents"]["drafted_tokens"], m["documents"]["accepted_tokens"]) == (16, 6)
    assert m["documents"]["acceptance_rate"] == pytest.approx(6 / 16)
    assert m["interactive"]["acceptance_rate"] is None  # nothing drafted: no rate
    assert (m["all"]["drafted_tokens"], m["all"]["accepted_tokens"]) == (16, 6)
    passed = Condition.parse("documents.acceptance_rate>=0.3").evaluate(m, m)
    assert passed["passed"] and passed["candidate"] == pytest.approx(0.375)
    missing = Condition.parse("interactive.acceptance_rate>=0.3").evaluate(m, m)
    assert not missing["passed"] and missing["note"] == "figure missing"


def test_the_report_shows_drafted_accepted_and_acceptance_per_group() -> None:
    engine = {"method": "ngram", "drafted_tokens": 16, "accepted_tokens": 6, "acceptance_rate": 0.375,
              "per_class": {}}
    report = {
        "title": "engine, profile quoting",
        "workload": {"description": "profile quoting", "num_requests": 3, "trace_sha256": "0" * 64,
                     "respect_eos": True},
        "runs": {"engine": run(summary(), engine)},
        "inventory": inventory(None, {}),
    }
    md = report_markdown(report)
    assert "| documents | 16 | 6 | 37.5% |" in md and "| interactive | 0 | 0 | - |" in md
    assert "| all | 16 | 6 | 37.5% |" in md
    assert "speculation ngram: 6 of 16 drafted tokens accepted (37.5%)" in md
    assert "Requests stop at EOS" in md
    report["runs"]["engine"] = run(summarize(RunResult("engine", [], [], 0.0, 1.0), {}), None)
    assert "drafted tokens" not in report_markdown(report)  # speculation off: no table


def test_a_decision_sheet_shows_both_runs_speculation_when_one_has_it() -> None:
    off = summarize(RunResult("engine", [record("a", "documents", "completed", 0, 0)], [], 100.0, 102.0), {})
    on = summary()
    sheet = {
        "parameter": "speculative", "baseline_value": None, "candidate_value": "ngram",
        "hypothesis": "drafts from the document raise throughput",
        "input_set": {"description": "profile quoting", "num_requests": 3, "trace_sha256": "0" * 64,
                      "respect_eos": True},
        "decision": {"approved": True, "checks": []},
        "baseline": off, "candidate": on,
        "baseline_run": run(off, None), "candidate_run": run(on, None),
        "inventory": inventory(None, {}),
    }
    md = decision_markdown(sheet)
    baseline, candidate = md.split("## Candidate")
    assert "| documents | 0 | 0 | - |" in baseline and "| documents | 16 | 6 | 37.5% |" in candidate


def test_the_offline_run_records_each_requests_drafts_and_the_engines_totals(llama_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=4,
                                    request_classes=[RequestClassConfig("documents", max_running=4)]))
    step, stats = engine.step, engine.stats
    drafted = {"n": 0}

    def drafting_step() -> Any:  # an engine with speculation: outputs count drafts, stats total them
        outputs = step()
        for out in outputs:
            out.num_draft_tokens, out.num_accepted_tokens = 2 * len(out.token_ids), len(out.token_ids)
            drafted["n"] += 2 * out.num_new_tokens
        return outputs

    def drafting_stats() -> dict[str, Any]:
        n = drafted["n"]
        totals = {"drafted_tokens": n, "accepted_tokens": n // 2}
        return {**stats(), "speculation": {"method": "suffix", **totals, "acceptance_rate": None,
                                           "per_class": {"documents": totals}}}

    engine.step, engine.stats = drafting_step, drafting_stats  # type: ignore[method-assign]
    drafted["n"] = 100  # drafts before the run (a warm-up) are not the run's
    requests = [BenchRequest(f"r{i}", "documents", 0.0, max_tokens=5, prompt_token_ids=[5, 6, 7])
                for i in range(3)]
    result = run_engine(engine, requests)
    assert [(r.drafted_tokens, r.accepted_tokens) for r in result.records] == [(10, 5)] * 3
    assert result.speculation == speculation_delta(
        {"method": "suffix", "drafted_tokens": 100, "accepted_tokens": 50,
         "per_class": {"documents": {"drafted_tokens": 100, "accepted_tokens": 50}}},
        {"method": "suffix", "drafted_tokens": 130, "accepted_tokens": 65,
         "per_class": {"documents": {"drafted_tokens": 130, "accepted_tokens": 65}}},
    )
    assert result.speculation is not None and result.speculation["drafted_tokens"] == 30
    assert result.speculation["acceptance_rate"] == pytest.approx(0.5)
    assert result.speculation["per_class"] == {"documents": {"drafted_tokens": 30, "accepted_tokens": 15}}


def test_compare_takes_a_baseline_value_then_candidates(llama_dir: Path) -> None:
    opts = BenchOptions(model=str(llama_dir), spec=WorkloadSpec(profile="chat"))
    base, candidates = compare_arms(opts, "max_num_seqs", "4,8,16")
    assert base.engine["max_num_seqs"] == 4 and candidates == ["8", "16"]
    assert "max_num_seqs" not in opts.engine  # the options given are left as they were
    assert compare_arms(opts, "max_num_seqs", "8") == (opts, ["8"])
    with pytest.raises(ValueError, match="--compare"):
        compare_arms(opts, "max_num_seqs", "4,,8")
    assert parse_value("none") is None and parse_value("ngram") == "ngram"
    assert with_param(opts, "quantization", "none").engine["quantization"] is None


def test_compare_speculative_none_then_each_method(llama_dir: Path) -> None:
    opts = BenchOptions(model=str(llama_dir), spec=WorkloadSpec(profile="quoting"))
    base, candidates = compare_arms(opts, "speculative", "none,ngram,suffix")
    assert base.engine["speculative"] is None and candidates == ["ngram", "suffix"]
    assert with_param(base, "speculative", "ngram").engine["speculative"] == "ngram"  # the string, unchanged


def test_a_quoting_comparison_end_to_end(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "quoting"
    args = ["--model", str(llama_dir), "--profile", "quoting", "-n", "3", "--long-prompt", "30:50",
            "--long-output", "6:6", "--no-progress", "--no-matmul-bound", "--out", str(out),
            "--compare", "max_num_seqs=1,2,4", "--approve", "all.completed>=baseline"]
    assert main(args) == 0
    for value in (2, 4):
        sheet = json.loads((out / f"decision-max_num_seqs={value}.json").read_text())
        assert (sheet["baseline_value"], sheet["candidate_value"]) == (1, value)
        assert sheet["input_set"]["respect_eos"] is True
        assert "profile quoting" in sheet["input_set"]["description"]
        documents = sheet["candidate"]["documents"]
        assert documents["submitted"] == 3 and documents["failed"] == 0
        assert (documents["drafted_tokens"], documents["acceptance_rate"]) == (0, None)
        md = (out / f"decision-max_num_seqs={value}.md").read_text()
        assert "Requests stop at EOS" in md and "drafted tokens" not in md
    trace = [json.loads(line) for line in (out / "trace.jsonl").read_text().splitlines()]
    assert all("<|user|>" in r["prompt"] and r["max_tokens"] == 6 for r in trace)
