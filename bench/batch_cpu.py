"""`python -m conveyor.bench.batch_cpu`: the embedded server's CPU per batch line, outside the engine.

Each run starts a fresh `conveyor serve` (SQLite, in-process queue; bench/served_process.py, its threads
named for /proc), runs a warm-up batch, measures the server idle for a few seconds, uploads the measured
input (N one-token chat lines of `preset:tiny`: max_tokens 1) and then measures the process's CPU per thread
(bench/thread_cpu.py) from POST /v1/batches until the batch is `completed`: reading, judging and inserting
the lines (batch-runner), claiming and running their jobs (feeders, engine-host), recording outcomes
(job-writer), and writing the output file (batch-runner), plus the HTTP thread answering the bench's polls
(one GET every POLL_S). The upload is not in the window.

What is counted: the process's user + system CPU over the window (every thread, those that ended
included), per line. "Outside the engine" is that less the `engine-host` thread (the engine's steps: the
scheduler, the model's forward and the sampler for `preset:tiny` with CONVEYOR_NUM_THREADS=1, so no
intra-op pool runs the model elsewhere) and less `thread-namer` (the bench's own instrumentation). The
idle rate (CPU per second with nothing to do: feeders and loops polling) is reported beside it, not
subtracted. Every run checks the outputs: N lines, each a 200.

`--code NAME=DIR` (repeatable) runs the server code of another tree (a folder holding a `conveyor` package,
e.g. `git archive` of a commit) or `NAME=installed`; runs alternate between them, `--repeats` times, so a
before/after comparison shares one session's machine load.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from conveyor.bench.affinity import parse_cpus
from conveyor.bench.served_process import NAMER, ServedProcess
from conveyor.bench.thread_cpu import ThreadSample, cpu_by_name, sample_threads

ENGINE_THREAD = "engine-host"
POLL_S = 0.5  # the bench's GET /v1/batches/{id} while a batch runs
TERMINAL = {"completed", "failed", "expired", "cancelled"}
DEFAULT_ENV = {"CONVEYOR_MODEL": "preset:tiny", "CONVEYOR_NUM_THREADS": "1"}


@dataclass(frozen=True)
class BatchCpuOptions:
    lines: int = 5000
    warmup_lines: int = 500
    idle_s: float = 5.0
    repeats: int = 1
    codes: dict[str, Path | None] = field(default_factory=lambda: {"installed": None})
    env: dict[str, str] = field(default_factory=dict)  # CONVEYOR_* for the server, over DEFAULT_ENV
    server_cpus: Sequence[int] | None = None
    work_dir: Path | None = None
    timeout_s: float = 1800.0


def batch_input(lines: int, tag: str) -> bytes:
    """`lines` chat lines of one token each, in OpenAI's batch line shape."""
    rows = []
    for i in range(lines):
        body = {"messages": [{"role": "user", "content": f"Line {i} of {tag}: answer with one word."}],
                "max_tokens": 1}
        rows.append(json.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}))
    return ("\n".join(rows) + "\n").encode()


def upload(client: httpx.Client, data: bytes) -> str:
    answer = client.post("/v1/files", data={"purpose": "batch"},
                         files={"file": ("lines.jsonl", data, "application/jsonl")})
    answer.raise_for_status()
    return str(answer.json()["id"])


def run_batch(client: httpx.Client, file_id: str, timeout_s: float) -> dict[str, Any]:
    """Creates the batch and polls it until it ends; its final object."""
    answer = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                              "completion_window": "24h"})
    answer.raise_for_status()
    batch_id = answer.json()["id"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch: dict[str, Any] = client.get(f"/v1/batches/{batch_id}").raise_for_status().json()
        if batch["status"] in TERMINAL:
            return batch
        time.sleep(POLL_S)
    raise TimeoutError(f"batch {batch_id} not finished after {timeout_s:.0f} s")


def check_outputs(client: httpx.Client, batch: dict[str, Any], lines: int) -> None:
    """Every line answered with a 200 in the output file, none in the error file."""
    if batch["status"] != "completed" or batch["request_counts"]["completed"] != lines:
        raise RuntimeError(f"batch {batch['id']}: {batch['status']}, counts {batch['request_counts']}")
    content = client.get(f"/v1/files/{batch['output_file_id']}/content").raise_for_status().content
    answers = [json.loads(line) for line in content.splitlines()]
    ok = sum(1 for answer in answers if (answer.get("response") or {}).get("status_code") == 200)
    if len(answers) != lines or ok != lines or batch.get("error_file_id"):
        raise RuntimeError(f"batch {batch['id']}: {len(answers)} output lines, {ok} answered 200, error file "
                           f"{batch.get('error_file_id')}")


def idle_rate(pid: int, seconds: float) -> float:
    """The server's CPU seconds per second with nothing to do (the thread-namer left out)."""
    before = sample_threads(pid)
    time.sleep(seconds)
    spent = cpu_by_name(before, sample_threads(pid))
    return (sum(spent.values()) - spent.get(NAMER, 0.0)) / seconds


def figures(spent: dict[str, float], lines: int, wall_s: float, idle_per_s: float) -> dict[str, Any]:
    """Per line: the process's CPU, the engine's, and the rest (less the bench's thread-namer); per thread."""
    total = sum(spent.values())
    engine, namer = spent.get(ENGINE_THREAD, 0.0), spent.get(NAMER, 0.0)
    per_line = {name: 1000 * cpu / lines for name, cpu in sorted(spent.items(), key=lambda kv: -kv[1])}
    return {
        "lines": lines, "wall_s": wall_s, "lines_per_s": lines / wall_s,
        "cpu_ms_per_line": 1000 * (total - namer) / lines,
        "engine_ms_per_line": 1000 * engine / lines,
        "outside_engine_ms_per_line": 1000 * (total - engine - namer) / lines,
        "idle_cpu_per_s": idle_per_s,
        "idle_ms_per_line": 1000 * idle_per_s * wall_s / lines,  # what the window would have cost idle
        "threads_ms_per_line": per_line,
    }


def one_run(name: str, code: Path | None, options: BatchCpuOptions, index: int, work_dir: Path,
            ) -> dict[str, Any]:
    data_dir = work_dir / f"{name}-{index}"
    server = ServedProcess(port=_free_port(), data_dir=data_dir, env={**DEFAULT_ENV, **options.env},
                           cpus=options.server_cpus, code=code)
    with server, httpx.Client(base_url=server.url, timeout=60.0) as client:
        warm = run_batch(client, upload(client, batch_input(options.warmup_lines, "warm")), options.timeout_s)
        check_outputs(client, warm, options.warmup_lines)
        idle_per_s = idle_rate(server.pid, options.idle_s)
        file_id = upload(client, batch_input(options.lines, "measured"))
        before: ThreadSample = sample_threads(server.pid)
        started = time.monotonic()
        batch = run_batch(client, file_id, options.timeout_s)
        wall_s = time.monotonic() - started
        spent = cpu_by_name(before, sample_threads(server.pid))
        check_outputs(client, batch, options.lines)
    return {"code": name, "run": index, **figures(spent, options.lines, wall_s, idle_per_s)}


def bench_batches(options: BatchCpuOptions) -> list[dict[str, Any]]:
    """Every code `repeats` times, alternating."""
    work_dir = options.work_dir or Path(tempfile.mkdtemp(prefix="batch-cpu-"))
    runs = []
    for index in range(options.repeats):
        for name, code in options.codes.items():
            run = one_run(name, code, options, index, work_dir)
            print(_summary(run), file=sys.stderr, flush=True)
            runs.append(run)
    return runs


TABLE_COLUMNS = {"outside_engine_ms_per_line": "CPU ms per line, outside the engine",
                 "engine_ms_per_line": "engine-host", "cpu_ms_per_line": "whole process",
                 "idle_ms_per_line": "idle ms/line", "lines_per_s": "lines/s"}


def table(runs: list[dict[str, Any]]) -> str:
    """A Markdown table: per code, the median of each figure and every run's value."""
    rows = ["| code | runs | " + " | ".join(TABLE_COLUMNS.values()) + " |",
            "|---|---|" + "---|" * len(TABLE_COLUMNS)]
    for name in dict.fromkeys(run["code"] for run in runs):
        mine = [run for run in runs if run["code"] == name]
        cells = [_cell([run[key] for run in mine]) for key in TABLE_COLUMNS]
        rows.append(f"| {name} | {len(mine)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _cell(values: list[float]) -> str:
    """The median in bold, then each run's value when there are several."""
    median = f"**{statistics.median(values):.3g}**"
    return median if len(values) == 1 else f"{median} ({' / '.join(f'{v:.3g}' for v in values)})"


def thread_table(runs: list[dict[str, Any]]) -> str:
    """Per thread name and code: the median CPU ms per line."""
    names = list(dict.fromkeys(n for run in runs for n in run["threads_ms_per_line"]))
    codes = list(dict.fromkeys(run["code"] for run in runs))
    rows = ["| thread | " + " | ".join(codes) + " |", "|---|" + "---|" * len(codes)]
    for thread in names:
        cells = [statistics.median(run["threads_ms_per_line"].get(thread, 0.0) for run in runs
                                   if run["code"] == code) for code in codes]
        rows.append(f"| {thread} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    return "\n".join(rows)


def _summary(run: dict[str, Any]) -> str:
    return (f"{run['code']} run {run['run']}: {run['outside_engine_ms_per_line']:.3f} ms/line outside the "
            f"engine, {run['engine_ms_per_line']:.3f} engine-host, {run['lines_per_s']:.0f} lines/s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _code(text: str) -> tuple[str, Path | None]:
    name, sep, where = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--code {text!r}: expected NAME=DIR or NAME=installed")
    return name, None if where == "installed" else Path(where)


def _env(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.startswith("CONVEYOR_"):
        raise argparse.ArgumentTypeError(f"--env {text!r}: expected CONVEYOR_NAME=VALUE")
    return key, value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m conveyor.bench.batch_cpu",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("-n", "--lines", type=int, default=BatchCpuOptions.lines,
                   help="lines of the measured batch")
    p.add_argument("--warmup-lines", type=int, default=BatchCpuOptions.warmup_lines)
    p.add_argument("--idle-s", type=float, default=BatchCpuOptions.idle_s, help="seconds of idle measured")
    p.add_argument("--repeats", type=int, default=1, help="runs of each code, alternating")
    p.add_argument("--code", type=_code, action="append", default=[], metavar="NAME=DIR",
                   help="server code: a folder holding a `conveyor` package, or `installed` (default)")
    p.add_argument("--env", type=_env, action="append", default=[], metavar="CONVEYOR_NAME=VALUE",
                   help="a server setting (default: CONVEYOR_MODEL=preset:tiny CONVEYOR_NUM_THREADS=1)")
    p.add_argument("--server-cpus", type=parse_cpus, default=None, metavar="CPUS", help="taskset the server")
    p.add_argument("--work-dir", type=Path, default=None, help="where the servers' data dirs go")
    p.add_argument("--out", type=Path, default=None, help="write every run's figures here (JSON)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.lines < 1 or args.warmup_lines < 1 or args.repeats < 1:
        raise SystemExit("--lines, --warmup-lines and --repeats must be >= 1")
    options = BatchCpuOptions(lines=args.lines, warmup_lines=args.warmup_lines, idle_s=args.idle_s,
                              repeats=args.repeats, codes=dict(args.code or [("installed", None)]),
                              env=dict(args.env), server_cpus=args.server_cpus, work_dir=args.work_dir)
    runs = bench_batches(options)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(runs, indent=2) + "\n")
    print(table(runs))
    print()
    print(thread_table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
