"""`conveyor tune` (cli/tune.py) end to end on the tiny model: an exported trace's header gives the baseline,
two parameters of two values each, a sheet per change, the report, a snippet the service's loader reads;
a second invocation resumes; bad input exits 2 with a message naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conveyor.cli.tune import main
from conveyor.core.settings.service import load_settings


def write_trace(path: Path, source: str | None) -> Path:
    """An exported trace (header with the model's production settings, then 8 jobs); no header when
    source is None."""
    header: dict[str, Any] = {
        "conveyor_trace": 1, "version": "0.0.0", "exported_at": "2026-12-06T20:00:00Z",
        "since": "2026-12-06T19:00:00Z", "until": "2026-12-06T20:00:00Z",
        "filters": {"model": None, "queue": None, "tenant": None}, "with_text": False, "jobs": 8,
        "tenant_hash": {"method": "hmac-sha256", "key": "per-export"},
        "inventory": {"models": {"tiny": {
            "source": source, "engine": {"max_num_seqs": 8},
            "queues": {"interactive": {"max_running": 8, "priority": 0},
                       "documents": {"max_running": 2, "priority": 1}},
        }}, "settings": {}},
    }
    lines = [header] if source else []
    for i in range(8):
        group = "interactive" if i % 2 == 0 else "documents"
        lines.append({"request_id": f"j{i}", "arrival_s": 0.02 * i, "model": "tiny", "group": group,
                      "kind": "generation", "status": "succeeded", "prompt_tokens": 8 if i % 2 == 0 else 40,
                      "max_tokens": 4, "output_tokens": 4, "n": 1, "deadline_s": None, "priority": 0})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


ARGS = ["--param", "max_num_seqs=8,4", "--param", "queues.documents.max_running=2,1", "--repeats", "2",
        "--no-progress"]


def test_tune_writes_sheets_report_and_a_loadable_snippet(llama_dir: Path, tmp_path: Path) -> None:
    trace, out = write_trace(tmp_path / "prod.jsonl", str(llama_dir)), tmp_path / "out"
    assert main(["--trace", str(trace), "--out", str(out), *ARGS]) == 0
    assert sorted(p.name for p in (out / "sheets").glob("*.md")) == [
        "01-max_num_seqs=4.md", "02-queues.documents.max_running=1.md"]  # 8 and 2 are production's
    report = json.loads((out / "tune-report.json").read_text())
    assert report["baseline"]["configuration"] == {"max_num_seqs": 8, "queues.documents.max_running": 2}
    assert report["trace_model"] == "tiny" and report["model"] == str(llama_dir)
    assert report["baseline_from"] == "production's settings of tiny in the trace's header"
    assert report["engine_runs"] == 6
    recommended = report["recommended"]["configuration"]
    assert "## Recommended settings" in (out / "tune-report.md").read_text()
    settings = load_settings(out / "settings.toml")
    for name, change in report["changes"].items():
        documents = settings.queues["documents"]
        loaded = settings.max_num_seqs if name == "max_num_seqs" else documents.max_running
        assert loaded == change["recommended"] == recommended[name]
    assert set(settings.queues) == {"interactive", "documents"}

    # The same trace and parameters again: every run is found in the resume file.
    assert main(["--trace", str(trace), "--out", str(out), *ARGS]) == 0
    again = json.loads((out / "tune-report.json").read_text())
    assert again["engine_runs"] == 0 and again["steps"] == report["steps"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--param", "seed=1,2"], "param seed: not a setting of `conveyor serve`"),
        (["--param", "queues.batch.max_running=2"], "no queue 'batch'"),
        (["--param", "max_num_seqs=4", "--repeats", "0"], "repeats and passes must be >= 1"),
    ],
)
def test_bad_input_exits_2_naming_it(llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     extra: list[str], message: str) -> None:
    trace = write_trace(tmp_path / "prod.jsonl", str(llama_dir))
    assert main(["--trace", str(trace), "--out", str(tmp_path / "out"), "--no-progress", *extra]) == 2
    assert message in " ".join(capsys.readouterr().out.split())
    assert not (tmp_path / "out" / "tune-state.json").exists()  # refused before any run


def test_a_trace_without_header_needs_a_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "hand.jsonl", None)
    assert main(["--trace", str(trace), "--param", "max_num_seqs=4", "--no-progress"]) == 2
    assert "give --model" in capsys.readouterr().out
