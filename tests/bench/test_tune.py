"""`conveyor tune`'s search (bench/tune*.py): the adoption rule on fabricated summaries; the search, resume
and budget on a fake engine (run_target stubbed, the bench's real summaries of fabricated records); and one
real search on the tiny model, from a trace header's production settings."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from conveyor.bench import tune as tune_module
from conveyor.bench.experiment import BenchOptions
from conveyor.bench.records import RequestRecord, RunResult
from conveyor.bench.trace_replay import read_trace_header
from conveyor.bench.tune import TuneOptions, tune
from conveyor.bench.tune_judge import judge, mean_summary
from conveyor.bench.tune_params import parse_params, production_options, replayed_model
from conveyor.bench.workload import BenchRequest
from conveyor.core.settings.service import load_settings

QUIET = Console(file=io.StringIO())


def write_trace(path: Path, header: dict[str, Any] | None = None) -> Path:
    """8 requests, alternately interactive (8 prompt tokens) and documents (40), 4 output tokens each."""
    lines = [header] if header else []
    for i in range(8):
        group = "interactive" if i % 2 == 0 else "documents"
        lines.append({"request_id": f"r{i}", "arrival_s": 0.02 * i, "group": group, "max_tokens": 4,
                      "prompt_tokens": 8 if group == "interactive" else 40})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def summary(goodput: float, shares: dict[str, float | None]) -> dict[str, Any]:
    """A run summary with only what the adoption rule reads."""
    metrics: dict[str, Any] = {g: {"deadline_attainment": s} for g, s in shares.items()}
    metrics["all"] = {"goodput_rps": goodput, "deadline_attainment": None}
    return {"duration_s": 1.0, "metrics": metrics}


# --- the adoption rule ---------------------------------------------------------------------------------


def test_noise_blocks_a_small_gain() -> None:
    current = [summary(10.0, {}), summary(12.0, {})]  # spread 2
    candidate = [summary(11.5, {}), summary(12.5, {})]  # mean gain 1
    decision = judge("goodput", current, candidate)
    assert decision["approved"] is False
    assert (decision["gain"], decision["noise"]) == (1.0, 2.0)
    assert "within the noise" in decision["reason"]


def test_a_deadline_share_drop_blocks_a_gain() -> None:
    current = [summary(10.0, {"interactive": 1.0, "batch": None}), summary(10.1, {"interactive": 1.0})]
    candidate = [summary(20.0, {"interactive": 0.75}), summary(20.1, {"interactive": 0.75})]
    decision = judge("goodput", current, candidate)
    assert decision["approved"] is False
    shares = [c for c in decision["checks"] if c["condition"].startswith("interactive")]
    assert [(c["candidate"], c["threshold"], c["passed"]) for c in shares] == [(0.75, 1.0, False)]
    assert not any(c["condition"].startswith("batch") for c in decision["checks"])  # no deadline: no check
    assert "on-time share fell in interactive" in decision["reason"]


def test_a_clear_gain_is_adopted_within_the_share_spread() -> None:
    current = [summary(10.0, {"interactive": 0.9}), summary(10.5, {"interactive": 1.0})]
    candidate = [summary(15.0, {"interactive": 0.85}), summary(15.2, {"interactive": 0.95})]  # >= 0.95 - 0.1
    decision = judge("goodput", current, candidate)
    assert decision["approved"] is True
    assert decision["gain"] == pytest.approx(4.85)


def test_mean_summary_averages_numbers_and_keeps_the_rest() -> None:
    runs = [{"a": 1, "b": {"p50": 0.5, "x": None}, "t": "engine"}, {"a": 2, "b": {"p50": 1.5, "x": None},
                                                                    "t": "engine"}]
    assert mean_summary(runs) == {"a": 1.5, "b": {"p50": 1.0, "x": None}, "t": "engine"}
    assert mean_summary([{"n": 4}, {"n": 4}]) == {"n": 4} and isinstance(mean_summary([4, 4]), int)


# --- the search on a fake engine -------------------------------------------------------------------------


FakeEngine = list[BenchOptions]  # the options of every run made


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> FakeEngine:
    """run_target stubbed: every request completes; max_num_seqs=4 or documents.max_running=2 halve the
    wall time (goodput doubles, a clear gain); max_num_batched_tokens=256 is faster still but makes
    interactive requests miss their 10 s deadline. Odd runs are 1% slower: the noise."""
    runs: FakeEngine = []

    def run_target(opts: BenchOptions, requests: list[BenchRequest], _: Console) -> tuple[RunResult, None]:
        runs.append(opts)
        fast = opts.engine.get("max_num_seqs") == 4 or opts.max_running.get("documents") == 2
        late = opts.engine.get("max_num_batched_tokens") == 256
        duration = (0.5 if fast else 1.0) * (0.4 if late else 1.0) * (1.01 if len(runs) % 2 else 1.0)
        records = [_record(r, 20.0 if late and r.group == "interactive" else 0.01) for r in requests]
        return RunResult("engine", records, [], start_time=0.0, end_time=duration), None

    monkeypatch.setattr(tune_module, "run_target", run_target)
    return runs


def _record(request: BenchRequest, e2e: float) -> RequestRecord:
    return RequestRecord(request.request_id, request.group, arrival_time=0.0, max_tokens=request.max_tokens,
                         prompt_tokens=8, output_tokens=request.max_tokens, status="completed",
                         first_scheduled_time=0.001, first_token_time=0.002, finished_time=e2e)


def search(llama_dir: Path, trace: Path, out: Path, params: list[str], **kwargs: Any) -> dict[str, Any]:
    opts = BenchOptions(model=str(llama_dir), trace=str(trace), progress=False)
    tune_opts = TuneOptions(trace=trace, params=parse_params(params, opts), out_dir=out, repeats=2,
                            progress=False, **kwargs)
    return tune(opts, tune_opts, QUIET)


TWO_PARAMS = ["max_num_seqs=4,64", "max_num_batched_tokens=256,2048"]  # 64 and 2048: the baseline's


def test_search_adopts_a_clear_gain_and_continues_from_it(
    llama_dir: Path, tmp_path: Path, fake_engine: FakeEngine
) -> None:
    out = tmp_path / "out"
    report = search(llama_dir, write_trace(tmp_path / "t.jsonl"), out, TWO_PARAMS)
    steps = [(s["parameter"], s["from"], s["to"], s["adopted"]) for s in report["steps"]]
    assert steps == [("max_num_seqs", 64, 4, True), ("max_num_batched_tokens", 2048, 256, False)]
    # The second parameter is tried from the adopted value, and refused for the interactive deadline.
    assert report["steps"][1]["current"] == {"max_num_seqs": 4, "max_num_batched_tokens": 2048}
    assert "on-time share fell in interactive" in report["steps"][1]["reason"]
    assert len(fake_engine) == 3 * 2  # baseline and two candidates, two repeats each
    sheets = sorted((out / "sheets").glob("*.json"))
    assert [p.stem for p in sheets] == ["01-max_num_seqs=4", "02-max_num_batched_tokens=256"]
    sheet = json.loads(sheets[1].read_text())
    assert (sheet["parameter"], sheet["baseline_value"], sheet["candidate_value"]) == (
        "max_num_batched_tokens", 2048, 256)
    assert sheet["configurations"]["baseline"]["max_num_seqs"] == 4
    inputs = sheet["input_set"]
    assert inputs["trace_path"].endswith("t.jsonl") and len(inputs["trace_sha256"]) == 64
    assert sheet["candidate"]["interactive"]["deadline_attainment"] == 0.0
    md = (out / "sheets" / "02-max_num_batched_tokens=256.md").read_text()
    assert "REJECTED" in md and "## Repeats: goodput per run" in md and "spread" in md

    assert report["recommended"]["configuration"] == {"max_num_seqs": 4, "max_num_batched_tokens": 2048}
    assert report["changes"] == {"max_num_seqs": {"baseline": 64, "recommended": 4}}
    text = (out / "tune-report.md").read_text()
    assert "| `max_num_seqs` | 64 | 4 |" in text and "ADOPTED" in text
    assert (out / "tune_objective.png").stat().st_size > 0 and (out / "tune_on_time.png").stat().st_size > 0
    assert len((out / "tune-log.txt").read_text().splitlines()) == 6 + 2  # a line per run and per step

    settings = load_settings(out / "settings.toml")
    assert settings.max_num_seqs == 4
    assert settings.max_num_batched_tokens is None  # unchanged: not in the snippet, the deployment's stands
    assert set(settings.queues) == {"interactive", "documents"}


def test_queue_parameter_goes_into_a_partial_queue_table(
    llama_dir: Path, tmp_path: Path, fake_engine: FakeEngine
) -> None:
    out = tmp_path / "out"
    report = search(llama_dir, write_trace(tmp_path / "t.jsonl"), out, ["queues.documents.max_running=2"])
    assert report["changes"] == {"queues.documents.max_running": {"baseline": 64, "recommended": 2}}
    assert fake_engine[-1].max_running == {"documents": 2}
    snippet = (out / "settings.toml").read_text()
    assert "[queues.documents]\nmax_running = 2\n" in snippet
    settings = load_settings(out / "settings.toml")
    assert settings.queues["documents"].max_running == 2
    assert settings.queues["documents"].max_prompt_tokens == 32768  # the other fields keep their defaults
    assert settings.queues["interactive"].max_running == 16  # and so does the other queue


def test_a_queue_the_trace_lacks_is_refused(llama_dir: Path, tmp_path: Path) -> None:
    opts = BenchOptions(model=str(llama_dir), trace=str(write_trace(tmp_path / "t.jsonl")))
    with pytest.raises(ValueError, match=r"no queue 'batch'.*interactive.*documents"):
        parse_params(["queues.batch.max_running=2"], opts)
    with pytest.raises(ValueError, match=r"param max_num_seqs=0: .*max_running must be >= 1"):
        parse_params(["max_num_seqs=0"], opts)  # EngineConfig's own check, before any run


def test_budget_zero_runs_only_the_baseline_and_a_second_run_resumes(
    llama_dir: Path, tmp_path: Path, fake_engine: FakeEngine
) -> None:
    trace, out = write_trace(tmp_path / "t.jsonl"), tmp_path / "out"
    first = search(llama_dir, trace, out, TWO_PARAMS, budget_min=0)
    assert len(fake_engine) == 2 and first["steps"] == []
    assert [(u["parameter"], u["value"]) for u in first["untried"]] == [("max_num_seqs", 4),
                                                                         ("max_num_batched_tokens", 256)]
    assert "Left untried (budget)" in (out / "tune-report.md").read_text()
    assert load_settings(out / "settings.toml").max_num_seqs is None  # nothing recommended over the baseline

    second = search(llama_dir, trace, out, TWO_PARAMS)
    assert len(fake_engine) == 2 + 4  # the baseline's two runs came from the state file
    assert second["engine_runs"] == 4 and second["untried"] == []
    assert second["baseline"]["objective"]["values"] == first["baseline"]["objective"]["values"]
    third = search(llama_dir, trace, out, TWO_PARAMS)
    assert len(fake_engine) == 6 and third["steps"] == second["steps"]  # everything found again


def test_another_trace_or_params_in_the_same_out_is_refused(
    llama_dir: Path, tmp_path: Path, fake_engine: FakeEngine
) -> None:
    trace, out = write_trace(tmp_path / "t.jsonl"), tmp_path / "out"
    search(llama_dir, trace, out, ["max_num_seqs=4"])
    assert len(list((out / "sheets").glob("*.md"))) == 1
    with pytest.raises(ValueError, match=r"another params.*--out.*--fresh"):
        search(llama_dir, trace, out, ["max_num_seqs=8"], budget_min=0)
    trace.write_text(trace.read_text().replace('"max_tokens": 4', '"max_tokens": 3'))
    with pytest.raises(ValueError, match=r"another trace_sha256.*--fresh"):
        search(llama_dir, trace, out, ["max_num_seqs=4"], budget_min=0)
    search(llama_dir, trace, out, ["max_num_seqs=4"], budget_min=0, fresh=True)
    assert len(fake_engine) == 6  # the fresh start measured its baseline again
    assert not list((out / "sheets").glob("*.md"))  # and the earlier tuning's sheet is gone


# --- a real search on the tiny model ---------------------------------------------------------------------


def exported_header(source: str) -> dict[str, Any]:
    """An exported trace's header, as `conveyor trace export` writes it (the fields the tuner reads)."""
    return {
        "conveyor_trace": 1, "version": "0.0.0", "exported_at": "2026-12-06T20:00:00Z",
        "since": "2026-12-06T19:00:00Z", "until": "2026-12-06T20:00:00Z",
        "filters": {"model": None, "queue": None, "tenant": None}, "with_text": False, "jobs": 8,
        "tenant_hash": {"method": "hmac-sha256", "key": "per-export"},
        "inventory": {"models": {"tiny": {
            "source": source,
            "engine": {"max_num_seqs": 8, "device": "cuda"},
            "queues": {"interactive": {"max_running": 8, "priority": 0},
                       "documents": {"max_running": 2, "priority": 1}},
        }}, "settings": {"auth_enabled": False}},
    }


def test_the_replayed_model_is_the_one_chosen_or_the_only_one() -> None:
    entry = {"source": "preset:tiny", "engine": {}, "queues": {}}
    header = {"inventory": {"models": {"a": entry, "b": {**entry, "source": "preset:llama-25m"}}}}
    with pytest.raises(ValueError, match=r"several models \(a, b\).*--trace-model"):
        replayed_model(header, None)
    assert replayed_model(header, "b") == ("b", {**entry, "source": "preset:llama-25m"})
    with pytest.raises(ValueError, match="no model 'c'; it has a, b"):
        replayed_model(header, "c")
    assert replayed_model(None, None) == (None, {})  # a hand-written trace: the bench's defaults


def test_tune_on_the_tiny_model_from_production_settings(llama_dir: Path, tmp_path: Path) -> None:
    trace, out = write_trace(tmp_path / "t.jsonl", exported_header(str(llama_dir))), tmp_path / "out"
    model_id, entry = replayed_model(read_trace_header(trace), None)
    assert model_id == "tiny"
    opts, skipped = production_options(
        BenchOptions(model=entry["source"], trace=str(trace), progress=False), entry)
    assert skipped == ["device"] and opts.engine == {"max_num_seqs": 8} and opts.max_running["documents"] == 2
    params = parse_params(["max_num_seqs=8,4", "queues.documents.max_running=2,1"], opts)  # 8, 2: production
    report = tune(opts, TuneOptions(trace=trace, params=params, out_dir=out, repeats=2, progress=False,
                                    model_id=model_id), QUIET)
    assert report["baseline"]["configuration"] == {"max_num_seqs": 8, "queues.documents.max_running": 2}
    assert [(s["parameter"], s["to"]) for s in report["steps"]] == [("max_num_seqs", 4),
                                                                     ("queues.documents.max_running", 1)]
    assert len(list((out / "sheets").glob("*.md"))) == 2  # a sheet per candidate change, none for 8 or 2
    for config in report["configurations"]:
        assert len(config["objective"]["values"]) == 2 and config["metrics"]["all"]["completed"] == 8
    recommended = report["recommended"]["configuration"]
    text = (out / "tune-report.md").read_text()
    assert "## Recommended settings" in text
    for name, value in recommended.items():
        assert f"| `{name}` | {report['baseline']['configuration'][name]} | {value} |" in text
    settings = load_settings(out / "settings.toml")
    assert settings.max_num_seqs == (4 if recommended["max_num_seqs"] == 4 else None)
    assert settings.queues["documents"].max_running == (1 if recommended["queues.documents.max_running"] == 1
                                                        else 4)  # unchanged: the service's default stands
