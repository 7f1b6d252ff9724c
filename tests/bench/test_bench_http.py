"""The bench's HTTP target against the real embedded service (`conveyor serve` in a subprocess on the tiny
model): jobs on both queues complete, a job cancelled mid-flight is counted as cancelled, token counts come
from the jobs' usage. The bench itself imports nothing from api/ or worker/; only this test starts them."""

from __future__ import annotations

import json
from pathlib import Path

from conveyor.bench.cli import main
from conveyor.bench.http_target import _queue_sample


def test_http_target_against_the_embedded_service(service: str, llama_dir: Path, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"group": "interactive", "prompt": "Good morning! How are you today?", "max_tokens": 4},
        {"group": "interactive", "prompt_tokens": 12, "max_tokens": 3, "arrival_s": 0.05},
        {"group": "documents", "prompt_tokens": 80, "max_tokens": 5, "arrival_s": 0.1},
        # Long enough that a 20 ms poll sees it running: the bench cancels it mid-flight.
        {"group": "documents", "prompt_tokens": 40, "max_tokens": 600, "cancel_after_tokens": 1},
    ]
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "http"
    assert (
        main(
            [
                "--target",
                "http",
                "--url",
                service,
                "--model",
                str(llama_dir),
                "--trace",
                str(trace),
                "--poll",
                "0.02",
                "--timeout",
                "120",
                "--no-progress",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads((out / "report.json").read_text())
    metrics = report["runs"]["http"]["metrics"]
    assert (metrics["all"]["submitted"], metrics["all"]["completed"], metrics["all"]["cancelled"]) == (
        4,
        3,
        1,
    )
    assert metrics["all"]["failed"] == 0
    assert metrics["interactive"]["output_tokens"] == 7 and metrics["documents"]["output_tokens"] == 5
    assert metrics["interactive"]["ttft_s"]["p50"] is not None and metrics["all"]["e2e_s"]["p99"] > 0
    assert report["inventory"]["parameters"]["url"] == service
    assert (out / "latency_cdf.png").read_bytes()[:4] == b"\x89PNG"


def test_the_queue_sampler_adds_up_each_queue_over_the_models() -> None:
    body = {"data": [{"model": "small", "name": "interactive", "queued": 2, "running": 1},
                     {"model": "large", "name": "interactive", "queued": 3, "running": 0},
                     {"model": "large", "name": "documents", "queued": 1, "running": 4}]}
    sample = _queue_sample(body, 1.5)
    assert sample.waiting == {"interactive": 5, "documents": 1}
    assert sample.running == {"interactive": 1, "documents": 4}
