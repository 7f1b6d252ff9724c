"""`conveyor top`: percentiles from histogram buckets, rates between frames, the tables it draws from the
API's and a worker's metrics (goodput per queue: the on-time share and on-time jobs per second), and an
endpoint it cannot read shown as such."""

from __future__ import annotations

import re

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from rich.console import Console
from typer.testing import CliRunner

from conveyor.cli.main import app
from conveyor.cli.top import Frame, Source, on_time_ratio, quantile, rate, read, render, run_top
from tests.support.live_server import free_port, serving

API_TEXT = """\
conveyor_queue_depth{model="small",queue="interactive"} 3
conveyor_queue_running{model="small",queue="interactive"} 2
conveyor_queue_scheduled{model="small",queue="interactive"} 47
conveyor_queue_workers{model="small",queue="interactive"} 1
conveyor_queue_default_ttl_seconds{model="small",queue="interactive"} 600
conveyor_job_outcomes_total{model="small",queue="interactive",status="succeeded"} 40
conveyor_job_outcomes_total{model="small",queue="interactive",status="cancelled"} 2
"""
WORKER_TEXT = """\
conveyor:kv_cache_usage_perc{model="small"} 0.5
conveyor:num_requests_running{model="small",queue="interactive"} 2
conveyor:num_requests_waiting{model="small",queue="interactive"} 1
conveyor:num_preemptions_total{model="small",queue="interactive"} 7
"""


def source(url: str, samples: list[tuple[str, dict[str, str], float]]) -> Source:
    return Source(url, samples)


def buckets(
    name: str, counts: list[tuple[str, float]], **labels: str
) -> list[tuple[str, dict[str, str], float]]:
    return [(f"{name}_bucket", {**labels, "le": le}, n) for le, n in counts]


def test_quantile_interpolates_within_the_bucket_like_promql() -> None:
    src = source("api", buckets("h", [("1.0", 2), ("2.0", 4), ("+Inf", 4)], queue="q"))
    assert quantile(src, "h", 0.5, queue="q") == 1.0
    assert quantile(src, "h", 0.75, queue="q") == 1.5
    assert quantile(src, "h", 0.5, queue="other") is None  # no such series


def test_rates_are_the_change_between_frames() -> None:
    before = Frame(10.0, source("api", [("c_total", {}, 10.0)]), [])
    now = Frame(12.0, source("api", [("c_total", {}, 16.0)]), [])
    assert rate(now, before, lambda f: f.api.value("c_total")) == 3.0
    assert rate(now, None, lambda f: f.api.value("c_total")) is None


def goodput_frame(at: float, on_time_default: float, on_time_priority: float, late: float,
                  missed: float) -> Frame:
    """The API's deadline counters of the interactive queue, in two tiers, at `at`."""
    def deadlines(tier: str, outcome: str, n: float) -> tuple[str, dict[str, str], float]:
        return ("conveyor_job_deadlines_total", {"queue": "interactive", "tier": tier, "outcome": outcome}, n)

    samples = [
        ("conveyor_queue_depth", {"queue": "interactive"}, 0.0),
        deadlines("default", "on_time", on_time_default),
        deadlines("priority", "on_time", on_time_priority),
        deadlines("default", "late", late),
        deadlines("flex", "missed", missed),
    ]
    return Frame(at, source("api", samples), [])


def queue_row(now: Frame, before: Frame | None) -> str:
    console = Console(record=True, width=250)
    console.print(render(now, before))
    return next(line for line in console.export_text().splitlines() if "interactive" in line)


def test_goodput_is_the_on_time_share_and_rate_between_frames_every_tier_together() -> None:
    before = goodput_frame(10.0, on_time_default=8, on_time_priority=1, late=0, missed=1)
    now = goodput_frame(12.0, on_time_default=11, on_time_priority=2, late=1, missed=1)
    # Between the frames: 4 on time (3 default, 1 priority) of 5 that ended (1 late), over 2 s.
    assert on_time_ratio(now, before, {"queue": "interactive"}) == 0.8
    row = queue_row(now, before)
    assert "80%" in row and "2.0/s" in row, row
    # The first frame: the share of every job counted so far (9 of 10), and no rate yet.
    assert on_time_ratio(before, None, {"queue": "interactive"}) == 0.9
    first = queue_row(before, None)
    assert "90%" in first and "/s" not in first, first
    # No job with a deadline ended between the frames: no share.
    assert on_time_ratio(goodput_frame(14.0, 11, 2, 1, 1), now, {"queue": "interactive"}) is None
    assert on_time_ratio(Frame(1.0, source("api", []), []), None, {"queue": "interactive"}) is None


def test_a_frame_read_from_the_api_and_a_worker() -> None:
    api, worker = FastAPI(), FastAPI()
    api.get("/metrics", response_class=PlainTextResponse)(lambda: API_TEXT)
    worker.get("/metrics", response_class=PlainTextResponse)(lambda: WORKER_TEXT)
    with serving(api) as api_url, serving(worker) as worker_url:
        now = Frame(
            1.0,
            read(api_url, "token"),
            [read(worker_url, None), read(f"http://127.0.0.1:{free_port()}", None)],
        )
    console = Console(record=True, width=200)
    console.print(render(now, None))
    text = console.export_text()
    assert "small" in text and "interactive" in text and "10.0 min" in text  # the lane's row, with its ttl
    assert "scheduled" in text and " 47 " in text  # its jobs not due yet
    assert "50%" in text and "int=2" in text and "int=1" in text  # the engine row: KV used, running, waiting
    assert now.workers[1].error and now.workers[1].url in text  # the unreachable one is named


def test_once_prints_one_frame_with_rates_over_the_interval() -> None:
    """Embedded: the API's /metrics has the engine's figures too, so the engine row comes from it."""
    counter = iter(range(0, 1000, 10))
    api = FastAPI()
    api.get("/metrics", response_class=PlainTextResponse)(
        lambda: (
            API_TEXT
            + WORKER_TEXT
            + f'conveyor:generation_tokens_total{{model="small",queue="interactive"}} {next(counter)}\n'
        )
    )
    console = Console(record=True, width=200)
    with serving(api) as url:
        run_top(url, [], None, interval_s=0.5, once=True, console=console)
    text = console.export_text()
    assert text.count("conveyor top") == 1 and "interactive" in text
    engine_rates = [float(r) for r in re.findall(r"(\d+\.\d)/s", text.split("Engines")[1])]
    assert max(engine_rates) > 0  # generated tokens per second: the counter grew between the two reads


def test_registered_as_a_command() -> None:
    result = CliRunner().invoke(app, ["top", "--help"])
    assert result.exit_code == 0 and "--worker" in result.output
