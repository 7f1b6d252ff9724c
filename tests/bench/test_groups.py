"""Groups come from the workload: a profile's short and long groups (`interactive` and `documents` unless
renamed), or whatever names a trace uses. Each group is an engine request class in-process and a service
queue over HTTP; the per-group flags accept exactly the workload's groups."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from conveyor.bench.cli import build_parser, main, options
from conveyor.bench.experiment import BenchOptions, with_param
from conveyor.bench.http_target import run_http
from conveyor.bench.workload import LONG, SHORT, BenchRequest, Range, WorkloadSpec, generate

QUICK = ["--no-progress", "--no-matmul-bound"]


def write_trace(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def test_a_trace_with_its_own_group_runs_in_process(llama_dir: Path, tmp_path: Path) -> None:
    trace = write_trace(
        tmp_path / "trace.jsonl",
        [
            {"group": "batch", "prompt_tokens": 20, "max_tokens": 3},
            {"group": "interactive", "prompt_tokens": 8, "max_tokens": 2},
            {"group": "batch", "prompt_tokens": 20, "max_tokens": 3},
        ],
    )
    out = tmp_path / "run"
    args = ["--model", str(llama_dir), "--trace", str(trace), "--set", "max_num_seqs=4", *QUICK]
    args += ["--deadline", "batch=30", "--max-running", "batch=1", "--priority", "batch=2"]
    assert main([*args, "--out", str(out)]) == 0
    report = load(out / "report.json")
    metrics = report["runs"]["engine"]["metrics"]
    assert set(metrics) == {"batch", "interactive", "all"}
    assert (metrics["batch"]["submitted"], metrics["batch"]["completed"]) == (2, 2)
    assert metrics["batch"]["output_tokens"] == 6 and metrics["interactive"]["completed"] == 1
    assert metrics["batch"]["peak_running"] == 1  # its request class's limit held
    assert (metrics["batch"]["deadline_s"], metrics["interactive"]["deadline_s"]) == (30.0, SHORT.deadline_s)
    params = report["inventory"]["parameters"]
    classes = [(c["name"], c["max_running"], c["priority"]) for c in params["engine"]["request_classes"]]
    assert classes == [("batch", 1, 2), ("interactive", 4, SHORT.priority)]  # the trace's order
    assert params["deadlines_s"] == {"interactive": SHORT.deadline_s, "batch": 30.0}
    assert "| batch |" in (out / "report.md").read_text()


def test_compare_on_a_custom_group_without_deadlines(llama_dir: Path, tmp_path: Path) -> None:
    # No group has a deadline, so the default approval is on completions alone (attainment has no figure).
    trace = write_trace(
        tmp_path / "trace.jsonl",
        [{"group": "bulk-docs", "prompt_tokens": 12, "max_tokens": 2} for _ in range(3)],
    )
    out = tmp_path / "cmp"
    args = ["--model", str(llama_dir), "--trace", str(trace), *QUICK, "--out", str(out)]
    assert main([*args, "--compare", "bulk-docs.max_running=1"]) == 0
    sheet = load(out / "decision.json")
    assert [c["condition"] for c in sheet["decision"]["checks"]] == ["all.completed>=baseline"]
    assert sheet["decision"]["approved"] is True
    assert sheet["candidate"]["bulk-docs"]["peak_running"] == 1
    assert sheet["candidate"]["bulk-docs"]["deadline_attainment"] is None


def test_per_group_flags_accept_only_the_workloads_groups(tmp_path: Path) -> None:
    def opts(*argv: str) -> BenchOptions:
        return options(build_parser().parse_args([*argv, "--out", str(tmp_path / "out")]))

    with pytest.raises(ValueError, match=r"--deadline.*'nope'.*interactive, documents"):
        opts("--deadline", "nope=3")
    with pytest.raises(ValueError, match=r"--max-running.*'documents'.*: interactive$"):
        opts("--profile", "short", "--max-running", "documents=2")
    trace = write_trace(tmp_path / "t.jsonl", [{"group": "batch", "prompt": "x", "max_tokens": 2}])
    with pytest.raises(ValueError, match=r"--priority.*'interactive'.*: batch$"):
        opts("--trace", str(trace), "--priority", "interactive=1")
    with pytest.raises(ValueError, match=r"--rate.*arrival_s"):
        opts("--trace", str(trace), "--rate", "batch=2")
    with pytest.raises(ValueError, match=r"--rate.*'interactive'.*chat, documents"):
        opts("--short-group", "chat", "--rate", "interactive=2")
    with pytest.raises(ValueError, match=r"--deadline: bad value"):
        opts("--deadline", "interactive=soon")
    assert opts("--trace", str(trace), "--deadline", "batch=5").deadlines_s() == {"batch": 5.0}
    assert opts("--trace", str(trace)).deadlines_s() == {}  # a group of its own has no default deadline
    with pytest.raises(ValueError, match=r"GROUP\.priority.*\['batch'\]"):
        with_param(BenchOptions(model="unused", trace=str(trace)), "interactive.priority", "1")


def test_a_bad_group_flag_is_reported_not_raised(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--model", str(llama_dir), "--deadline", "nope=3", "--out", str(tmp_path)]) == 2
    printed = " ".join(capsys.readouterr().out.split())
    assert "--deadline" in printed and "nope" in printed and "interactive, documents" in printed


def test_profiles_name_their_groups() -> None:
    assert WorkloadSpec(profile="short").groups() == [SHORT]
    assert WorkloadSpec(profile="long").groups() == [LONG]
    spec = WorkloadSpec(profile="mixed", num_requests=20, short_group="chat", long_group="bulk")
    groups = spec.groups()
    assert [(g.name, g.deadline_s, g.priority) for g in groups] == [
        ("chat", SHORT.deadline_s, SHORT.priority),
        ("bulk", LONG.deadline_s, LONG.priority),
    ]
    spec.long_prompt, spec.long_output = Range(30, 40), Range(5, 5)
    requests = generate(spec, list(range(3, 50)), 128)
    assert {r.group for r in requests} == {"chat", "bulk"}
    assert all(r.max_tokens == 5 for r in requests if r.group == "bulk")  # long lengths follow the group
    with pytest.raises(ValueError, match="short_group, long_group"):
        WorkloadSpec(short_group="same", long_group="same")
    with pytest.raises(ValueError, match="short_group"):
        WorkloadSpec(short_group="all")


def test_http_target_sends_each_request_to_its_groups_queue() -> None:
    queues: dict[str, str] = {}

    def service(request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path == "/v1/jobs":
            body = json.loads(request.content)
            job_id = body["metadata"]["bench_request_id"]
            queues[job_id] = body["queue"]
            job = {"id": job_id, "status": "succeeded", "created_at": 1000.0, "finished_at": 1001.0}
            return httpx.Response(201, json={**job, "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
        if request.url.path == "/v1/queues":
            return httpx.Response(200, json={"data": [{"name": "batch", "queued": 0, "running": 1}]})
        return httpx.Response(404)

    requests = [
        BenchRequest("r-batch", "batch", 0.0, 2, prompt="hello"),
        BenchRequest("r-chat", "interactive", 0.0, 2, prompt="hi"),
    ]
    result = run_http("http://service", requests, poll_s=0.01, transport=httpx.MockTransport(service))
    assert queues == {"r-batch": "batch", "r-chat": "interactive"}
    assert {r.request_id: (r.group, r.status) for r in result.records} == {
        "r-batch": ("batch", "completed"),
        "r-chat": ("interactive", "completed"),
    }


def test_the_deadlines_profile_sets_its_groups_apart_by_deadline_only() -> None:
    groups = WorkloadSpec(profile="deadlines").groups()
    assert [(g.name, g.priority) for g in groups] == [(SHORT.name, 0), (LONG.name, 0)]
    assert all(g.deadline_s is not None for g in groups)


@pytest.mark.parametrize(("scheduling", "first"), [("urgency", "chat"), ("arrival", "doc")])
def test_offline_requests_carry_their_groups_deadline_into_the_engine(
    llama_dir: Path, scheduling: str, first: str
) -> None:
    from conveyor.bench.offline import run_engine
    from conveyor.engine.config import EngineConfig, RequestClassConfig
    from conveyor.engine.llm_engine import LLMEngine

    classes = [RequestClassConfig(name, max_running=1) for name in ("documents", "interactive")]
    engine = LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=1, request_classes=classes,
                                    scheduling=scheduling))
    requests = [BenchRequest("doc", "documents", 0.0, 8, prompt_token_ids=[5, 6, 7]),
                BenchRequest("chat", "interactive", 0.0, 8, prompt_token_ids=[8, 9, 10])]
    result = run_engine(engine, requests, deadlines_s={"interactive": 0.5, "documents": 600.0})
    finished = sorted(result.records, key=lambda r: r.finished_time or 0.0)
    assert finished[0].request_id == first
