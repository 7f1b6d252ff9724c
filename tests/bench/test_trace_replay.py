"""Replaying a trace exported from the service (the header line, then one job a line): the header skipped and
recorded, each job at its recorded length, `n` choices as `n` requests, embedding jobs and other models' jobs
skipped and counted, per-request deadlines and priorities carried to the target and into the on-time counts,
`--load X` dividing the arrival times, chat messages rendered with the model's chat template; shapes-only
lines share the prompt blocks their `prefix_blocks` share, so the engine's prefix cache hits as it did."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from conveyor.bench.chat_format import ChatFormat
from conveyor.bench.cli import build_parser, main, options
from conveyor.bench.experiment import BenchOptions, build_workload
from conveyor.bench.http_target import run_http
from conveyor.bench.metrics import summarize
from conveyor.bench.offline import run_engine
from conveyor.bench.records import RequestRecord, RunResult
from conveyor.bench.trace_chat import MessageRenderer
from conveyor.bench.trace_replay import load_trace, read_trace_header, trace_lines
from conveyor.bench.workload import BenchRequest, WorkloadSpec
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.sequence import Urgency
from tests.support.bench_fake_service import FakeService

QUICK = ["--no-progress", "--no-matmul-bound"]
VOCAB = list(range(3, 40))
HEADER: dict[str, Any] = {
    "conveyor_trace": 1,
    "version": "0.1.0",
    "exported_at": "2026-12-06T20:00:00+00:00",
    "since": "2026-12-06T19:00:00+00:00",
    "until": "2026-12-06T20:00:00+00:00",
    "filters": {"model": None, "queue": None, "tenant": None},
    "with_text": False,
    "tenant_hash": {"method": "hmac-sha256", "key": "per-export"},
    "inventory": {"models": {"tiny": {"source": "preset:tiny", "engine": {"max_num_seqs": 4},
                                      "queues": {"interactive": {"max_running": 4, "priority": 0}}}},
                  "settings": {"auth_enabled": False}},
}


def job(request_id: str, arrival_s: float, **fields: Any) -> dict[str, Any]:
    """An exported job line: a succeeded generation job of model `tiny` unless `fields` say otherwise."""
    line: dict[str, Any] = {
        "request_id": request_id, "arrival_s": arrival_s, "model": "tiny", "group": "interactive",
        "kind": "generation", "status": "succeeded", "prompt_tokens": 8, "max_tokens": 16, "output_tokens": 3,
        "n": 1, "deadline_s": None, "priority": 0, "tier": None, "structured": False, "tools": False,
        "tool_call": False, "adapter": None, "tenant": "0123456789abcdef", "batch": False, "queue_s": 0.01,
        "ttft_s": 0.05, "e2e_s": 0.2, "preemptions": 0,
    }
    line.update(fields)
    return line


def write_trace(path: Path, jobs: list[dict[str, Any]], header: dict[str, Any] | None = HEADER) -> Path:
    lines = ([{**header, "jobs": len(jobs)}] if header is not None else []) + jobs
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def by_id(requests: list[BenchRequest]) -> dict[str, BenchRequest]:
    return {r.request_id: r for r in requests}


# --- reading the exported format -----------------------------------------------------------------------


def test_the_header_is_read_and_skipped(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [job("a", 0.0), job("b", 0.5)])
    header = read_trace_header(trace)
    assert header is not None and header["jobs"] == 2 and header["exported_at"] == HEADER["exported_at"]
    assert [r.request_id for r in load_trace(trace, VOCAB)] == ["a", "b"]
    plain = write_trace(tmp_path / "plain.jsonl", [{"group": "batch", "prompt": "x", "max_tokens": 2}], None)
    assert read_trace_header(plain) is None
    bad = write_trace(tmp_path / "v2.jsonl", [job("a", 0.0)], {**HEADER, "conveyor_trace": 2})
    with pytest.raises(ValueError, match="conveyor_trace 2"):
        load_trace(bad, VOCAB)


def test_each_job_is_replayed_at_its_recorded_length(tmp_path: Path) -> None:
    trace = write_trace(
        tmp_path / "t.jsonl",
        [
            job("done", 0.0, output_tokens=5),
            job("choices", 0.1, n=2, output_tokens=7),  # 7 tokens over two choices: 4 each
            job("cancelled", 0.2, status="cancelled", output_tokens=3, max_tokens=40),
            job("cancelled-late", 0.2, status="cancelled", output_tokens=40, max_tokens=40),
            job("unknown", 0.3, output_tokens=None, max_tokens=9),
            job("failed", 0.4, status="failed", output_tokens=2, max_tokens=11),
        ],
    )
    got = by_id(load_trace(trace, VOCAB))
    assert (got["done"].max_tokens, got["done"].cancel_after_tokens) == (5, None)
    assert [(rid, got[rid].max_tokens, got[rid].arrival_s) for rid in ("choices#0", "choices#1")] == [
        ("choices#0", 4, 0.1), ("choices#1", 4, 0.1)
    ]
    assert got["choices#0"].prompt_token_ids == got["choices#1"].prompt_token_ids  # one prompt, two choices
    assert (got["cancelled"].max_tokens, got["cancelled"].cancel_after_tokens) == (40, 3)
    assert (got["cancelled-late"].max_tokens, got["cancelled-late"].cancel_after_tokens) == (40, None)
    assert got["unknown"].max_tokens == 9 and got["failed"].max_tokens == 11
    assert all(len(r.prompt_token_ids or []) == 8 for r in got.values())


def test_embedding_jobs_and_other_models_are_skipped_and_counted(tmp_path: Path) -> None:
    jobs = [
        job("late", 4.0, model="other"),
        job("embed", 5.0, kind="embedding", max_tokens=1, output_tokens=None),
        job("a", 6.0, deadline_s=2.5, priority=3),
        job("b", 6.5),
    ]
    trace = write_trace(tmp_path / "t.jsonl", jobs)
    with pytest.raises(ValueError, match=r"several models \(other, tiny\).*--trace-model"):
        trace_lines(trace)
    with pytest.raises(ValueError, match=r"--trace-model.*'nope'.*other, tiny"):
        trace_lines(trace, "nope")
    lines = trace_lines(trace, "tiny")
    assert (lines.embedding_skipped, lines.other_models_skipped, lines.model) == (1, 1, "tiny")
    assert "1 embedding jobs skipped" in lines.describe()
    recorded = ("version", "exported_at", "since", "until")
    assert lines.record()["trace_header"] == {**{k: HEADER[k] for k in recorded}, "jobs": 4}
    got = load_trace(trace, VOCAB, model="tiny")
    # The first job replayed arrives at 0: no idle lead-in where the skipped jobs were.
    assert [(r.request_id, r.arrival_s, r.deadline_s, r.priority, r.model) for r in got] == [
        ("a", 0.0, 2.5, 3, "tiny"), ("b", 0.5, None, 0, "tiny")
    ]


def test_text_prompts_and_chat_messages(llama_dir: Path, tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi!"},
                {"role": "user", "content": "How are you?"}]
    trace = write_trace(
        tmp_path / "t.jsonl",
        [job("p", 0.0, prompt="Good morning", output="ok"), job("m", 0.1, messages=messages, output="ok")],
    )
    got = by_id(load_trace(trace, VOCAB, chat=MessageRenderer(str(llama_dir))))
    assert got["p"].prompt == "Good morning" and got["p"].prompt_token_ids is None  # the text over its length
    fmt = ChatFormat.from_model(str(llama_dir))
    one = MessageRenderer(str(llama_dir))([{"role": "user", "content": "Hello there"}])
    assert one == fmt.render("Hello there")  # BOS once, as the text profiles render a message
    prompt = got["m"].prompt
    assert prompt is not None and prompt.startswith(one.split("Hello there")[0])
    assert all(m["content"] in prompt for m in messages)
    assert fmt.tokenizer.encode(prompt).count(fmt.tokenizer.bos_token_id) == 1
    with pytest.raises(ValueError, match=r"line 3: messages.*--model"):
        load_trace(trace, VOCAB, chat=MessageRenderer(None))


# --- options and the workload ----------------------------------------------------------------------------


def parse(tmp_path: Path, *argv: str) -> BenchOptions:
    return options(build_parser().parse_args([*argv, "--out", str(tmp_path / "out")]))


def test_load_divides_a_traces_arrival_times(llama_dir: Path, tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [job("a", 0.0), job("b", 1.0), job("c", 3.0)])
    plain, _ = build_workload(parse(tmp_path, "--model", str(llama_dir), "--trace", str(trace)))
    opts = parse(tmp_path, "--model", str(llama_dir), "--trace", str(trace), "--load", "2")
    fast, description = build_workload(opts)
    assert [r.arrival_s for r in plain] == [0.0, 1.0, 3.0]
    assert [r.arrival_s for r in fast] == [0.0, 0.5, 1.5]
    assert "arrival_s / 2" in description
    # No capacity to measure: over HTTP too.
    assert parse(tmp_path, "--trace", str(trace), "--load", "0.5", "--target", "http", "--no-pin").load == 0.5
    with pytest.raises(ValueError, match=r"--load.*> 0"):
        parse(tmp_path, "--trace", str(trace), "--load", "0")
    with pytest.raises(ValueError, match=r"--trace-model.*--trace"):
        parse(tmp_path, "--trace-model", "tiny")


# --- the counting rule: each request's own deadline --------------------------------------------------


def test_on_time_uses_each_requests_own_deadline_else_its_groups() -> None:
    def record(rid: str, e2e: float, status: str = "completed", deadline_s: float | None = None) -> Any:
        group = "interactive" if rid.startswith("i-") else "batch"
        return RequestRecord(rid, group, arrival_time=100.0, max_tokens=2, output_tokens=2,
                             status=status, finished_time=100.0 + e2e, deadline_s=deadline_s)  # type: ignore[arg-type]

    records = [
        record("i-fast", 1.0),  # the group's 10 s: on time
        record("i-own-miss", 1.0, deadline_s=0.5),  # its own 0.5 s wins over the group's: late
        record("b-no-deadline", 50.0),  # no deadline at all: on time
        record("b-own-hit", 2.0, deadline_s=3.0),
        record("b-failed", 1.0, status="failed"),
    ]
    metrics = summarize(RunResult("engine", records, [], 100.0, 104.0), {"interactive": 10.0})
    assert (metrics["interactive"]["on_time"], metrics["interactive"]["deadline_attainment"]) == (1, 0.5)
    assert metrics["batch"]["on_time"] == 2 and metrics["batch"]["deadline_attainment"] == 1.0
    assert metrics["all"]["on_time"] == 3 and metrics["all"]["goodput_rps"] == pytest.approx(3 / 4.0)
    assert metrics["all"]["deadline_attainment"] == pytest.approx(2 / 3)  # i-fast, i-own-miss, b-own-hit


# --- prefix sharing in shapes-only lines ----------------------------------------------------------------


def test_lines_sharing_prefix_blocks_share_leading_ids_and_keep_their_own_tails(tmp_path: Path) -> None:
    jobs = [
        job("a", 0.0, prompt_tokens=40, prefix_blocks=["h1", "h2"]),
        job("b", 0.1, prompt_tokens=50, prefix_blocks=["h1", "h2", "h3"]),
        job("c", 0.2, prompt_tokens=32, prefix_blocks=["h1", "other"]),
        job("short", 0.3, prompt_tokens=9, prefix_blocks=[]),  # no full block
        job("text", 0.4, prompt_tokens=40, prefix_blocks=["h1", "h2"], prompt="recorded text wins"),
    ]
    got = by_id(load_trace(write_trace(tmp_path / "t.jsonl", jobs), VOCAB))
    ids = {rid: got[rid].prompt_token_ids or [] for rid in ("a", "b", "c", "short")}
    assert {rid: len(i) for rid, i in ids.items()} == {"a": 40, "b": 50, "c": 32, "short": 9}
    assert ids["a"][:32] == ids["b"][:32] and ids["a"][:16] == ids["c"][:16]
    assert ids["a"][16:32] != ids["c"][16:32]  # another second block
    assert ids["a"][32:] != ids["b"][32:40]  # each its own tail
    assert (got["text"].prompt, got["text"].prompt_token_ids) == ("recorded text wins", None)


def test_the_header_names_the_block_size_and_blocks_must_fit_the_prompt(tmp_path: Path) -> None:
    eights = write_trace(tmp_path / "eights.jsonl", [job("a", 0.0, prompt_tokens=20, prefix_blocks=["h"]),
                                                     job("b", 0.1, prompt_tokens=20, prefix_blocks=["h"])],
                         header={**HEADER, "prefix_block_tokens": 8})
    a, b = (r.prompt_token_ids or [] for r in load_trace(eights, VOCAB))
    assert (len(a), len(b)) == (20, 20) and a[:8] == b[:8] and a[8:] != b[8:]
    too_many = [job("a", 0.0, prompt_tokens=20, prefix_blocks=["h", "i"])]
    too_many_trace = write_trace(tmp_path / "bad.jsonl", too_many)
    with pytest.raises(ValueError, match=r"line 2: prefix_blocks: 2 blocks of 16 tokens exceed"):
        load_trace(too_many_trace, VOCAB)


def test_hand_written_lines_draw_the_same_prompts_as_before(tmp_path: Path) -> None:
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"arrival_s": 0, "group": "interactive", "max_tokens": 2, "prompt_tokens": 12}\n'
                     '{"arrival_s": 1, "group": "interactive", "max_tokens": 2, "prompt_tokens": 5}\n')
    rng = random.Random(7)
    drawn = [[rng.choice(VOCAB) for _ in range(length)] for length in (12, 5)]
    assert [r.prompt_token_ids for r in load_trace(plain, VOCAB, seed=7)] == drawn


# --- end to end -----------------------------------------------------------------------------------------


def test_an_exported_trace_replays_in_process(llama_dir: Path, tmp_path: Path) -> None:
    jobs = [
        job("a", 0.0, output_tokens=3),
        job("b", 0.0, n=2, output_tokens=5, group="documents", prompt_tokens=30),
        job("embed", 0.01, kind="embedding", max_tokens=1, output_tokens=None),
        job("other", 0.01, model="other"),
        job("cancelled", 0.02, status="cancelled", output_tokens=2, max_tokens=200),
        job("tight", 0.02, deadline_s=1e-6, priority=-1, output_tokens=2),  # misses its own deadline
        job("text", 0.03, prompt="Good morning! How are you?", output_tokens=4, output="fine"),
    ]
    trace = write_trace(tmp_path / "t.jsonl", jobs)
    out = tmp_path / "run"
    argv = ["--model", str(llama_dir), "--trace", str(trace), "--trace-model", "tiny", *QUICK]
    assert main([*argv, "--set", "max_num_seqs=4", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    workload = report["workload"]
    recorded = ("version", "exported_at", "since", "until")
    assert workload["trace_header"] == {**{k: HEADER[k] for k in recorded}, "jobs": len(jobs)}
    assert (workload["embedding_jobs_skipped"], workload["other_model_jobs_skipped"]) == (1, 1)
    assert "1 embedding jobs skipped" in workload["description"] and workload["trace_model"] == "tiny"
    run = report["runs"]["engine"]
    metrics = run["metrics"]["all"]
    counts = (metrics["submitted"], metrics["completed"], metrics["cancelled"], metrics["failed"])
    assert counts == (6, 5, 1, 0)
    assert metrics["on_time"] == 4 < metrics["completed"]
    assert metrics["goodput_rps"] == pytest.approx(4 / run["duration_s"])
    # a and text within the group's 10 s, tight not within its own deadline; the cancelled one not counted.
    assert run["metrics"]["interactive"]["deadline_attainment"] == pytest.approx(2 / 3)
    rows = {r["request_id"]: r for r in map(json.loads, (out / "requests.jsonl").read_text().splitlines())}
    outputs = {rid: r["output_tokens"] for rid, r in rows.items() if r["status"] == "completed"}
    assert outputs == {"a": 3, "b#0": 3, "b#1": 3, "tight": 2, "text": 4}  # b: 5 tokens over 2 choices
    assert rows["cancelled"]["status"] == "cancelled" and rows["cancelled"]["output_tokens"] < 200
    assert (rows["tight"]["deadline_s"], rows["tight"]["priority"]) == (1e-6, -1)
    assert rows["b#0"]["prompt_tokens"] == 30 and rows["text"]["prompt_tokens"] > 0


def test_shared_prefix_blocks_hit_the_engines_prefix_cache(llama_dir: Path, tmp_path: Path) -> None:
    """One job at a time (max_num_seqs 1): each later job finds the blocks of the earlier ones cached only
    when its line says it shares them."""
    shared = [job(f"q{i}", 0.01 * i, prompt_tokens=40, output_tokens=2, prefix_blocks=["manual", "excerpt"])
              for i in range(3)]
    unshared = [{k: v for k, v in line.items() if k != "prefix_blocks"} for line in shared]
    cache: dict[str, dict[str, Any]] = {}
    for name, jobs in (("shared", shared), ("unshared", unshared)):
        trace, out = write_trace(tmp_path / f"{name}.jsonl", jobs), tmp_path / name
        argv = ["--model", str(llama_dir), "--trace", str(trace), "--set", "max_num_seqs=1", *QUICK]
        assert main([*argv, "--out", str(out)]) == 0
        cache[name] = json.loads((out / "report.json").read_text())["runs"]["engine"]["prefix_cache"]
    assert cache["shared"]["hit_tokens"] > 0 and cache["shared"]["hit_rate"] > 0
    assert cache["shared"]["hit_tokens"] <= 2 * 32  # at most the shared blocks, for the two later jobs
    assert cache["unshared"]["hit_tokens"] == 0 and cache["unshared"]["hit_rate"] == 0


def test_the_engine_gets_each_requests_priority_and_deadline(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = LLMEngine(BenchOptions(model=str(llama_dir), spec=WorkloadSpec(profile="short")).engine_config())
    urgencies: dict[str, Urgency] = {}
    add_request = engine.add_request

    def spy(request_id: str, *args: Any, urgency: Urgency, **kwargs: Any) -> None:
        urgencies[request_id] = urgency
        add_request(request_id, *args, urgency=urgency, **kwargs)

    monkeypatch.setattr(engine, "add_request", spy)
    requests = [
        BenchRequest("urgent", "interactive", 0.0, 2, prompt_token_ids=[5, 6], deadline_s=2.5, priority=-3),
        BenchRequest("plain", "interactive", 0.0, 2, prompt_token_ids=[5, 6]),
    ]
    result = run_engine(engine, requests, deadlines_s={"interactive": 10.0})
    arrival = {r.request_id: r.arrival_time for r in result.records}
    assert urgencies["urgent"].priority == -3 and urgencies["plain"].priority == 0
    assert urgencies["urgent"].deadline == pytest.approx(arrival["urgent"] + 2.5)  # its own
    assert urgencies["plain"].deadline == pytest.approx(arrival["plain"] + 10.0)  # its group's


def test_the_http_target_sends_each_jobs_priority_deadline_and_model() -> None:
    bodies: list[dict[str, Any]] = []

    def keep(body: dict[str, Any]) -> None:
        bodies.append(body)

    fake = FakeService(refuse=keep)  # accepts every job, keeping its body
    requests = [
        BenchRequest("urgent", "interactive", 0.0, 1, prompt="hi", deadline_s=2.5, priority=-3,
                     model="small"),
        BenchRequest("plain", "interactive", 0.0, 1, prompt="hi"),
    ]
    result = run_http("http://service", requests, transport=fake.transport())
    assert all(r.status == "completed" for r in result.records)
    sent = {b["metadata"]["bench_request_id"]: b for b in bodies}
    urgent = sent["urgent"]
    assert (urgent["priority"], urgent["deadline_s"], urgent["model"]) == (-3, 2.5, "small")
    assert not {"priority", "deadline_s", "model"} & set(sent["plain"])  # the queue's and service's defaults
    assert {r.request_id: r.deadline_s for r in result.records} == {"urgent": 2.5, "plain": None}
