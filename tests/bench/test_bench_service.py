"""The service bench: one-token jobs in a closed loop (N in flight) or an open loop (fixed submit rate),
awaited with the long poll, refusals kept with their status, code and message; against an in-memory fake of
the jobs API (bench_fake_service.py) and, end to end through the CLI, against the real embedded service."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import pytest

from conveyor.bench.cli import main
from conveyor.bench.http_lanes import Lanes
from conveyor.bench.http_target import run_http
from conveyor.bench.report import service_markdown
from conveyor.bench.service import service_figures
from conveyor.bench.workload import BenchRequest, WorkloadSpec, generate, service_requests
from tests.support.bench_fake_service import FakeService

URL = "http://service"


def jobs(n: int, submit_rate: float | None = None) -> list[BenchRequest]:
    return service_requests(WorkloadSpec(profile="service", num_requests=n, submit_rate=submit_rate))


def test_closed_loop_keeps_n_jobs_in_flight_and_counts_every_completion() -> None:
    fake = FakeService(service_s=0.03, submit_s=0.005)
    result = run_http(URL, jobs(40), concurrency=4, transport=fake.transport())
    assert fake.peak_open == 4  # never more than N, and N were reached
    assert len(fake.created) == 40 and all(r.status == "completed" for r in result.records)
    figures = service_figures(result)
    counts = [figures[k] for k in ("submitted", "succeeded", "failed", "refused")]
    assert counts == [40, 40, 0, 0]
    assert 0.005 <= figures["submit_latency_s"]["p50"] <= figures["submit_latency_s"]["p99"] < 0.5
    # The jobs' own created_at -> finished_at, not when the client saw them end.
    assert figures["service_time_s"]["p99"] == pytest.approx(0.03, abs=1e-3)
    # Ten rounds of four jobs, each round at least a submit and a service time long.
    assert 10 * 0.035 <= figures["wall_s"] < 5.0
    assert figures["completions_per_s"] == pytest.approx(40 / figures["wall_s"])
    assert figures["submit_rate_per_s"] > 0
    assert figures["client_cpu_s"] > 0 and figures["client_cpu_per_job_ms"] > 0


def test_open_loop_submits_at_fixed_intervals_whatever_is_in_flight() -> None:
    fake = FakeService(service_s=0.2)  # ten submissions arrive during each job's service time
    result = run_http(URL, jobs(20, submit_rate=50.0), transport=fake.transport())
    gaps = [b - a for a, b in itertools.pairwise(fake.submits)]
    # The arrivals are fixed (test_service_workload_is_one_token_jobs_at_fixed_intervals); here, the rate
    # they are kept at while jobs are in flight. No minimum gap: on a busy machine a late submission may be
    # followed closely by the next, on-time one (it failed so, 2.5 ms apart, under the parallel suite).
    assert 0.015 < sum(gaps) / len(gaps) < 0.03
    assert fake.peak_open >= 8
    figures = service_figures(result)
    assert figures["succeeded"] == 20 and 35 < figures["submit_rate_per_s"] < 60
    assert figures["submit_latency_s"]["p99"] is not None


def test_service_workload_is_one_token_jobs_at_fixed_intervals() -> None:
    requests = jobs(5, submit_rate=4.0)
    assert [r.arrival_s for r in requests] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert all(r.max_tokens == 1 and r.prompt and r.prompt_token_ids is None for r in requests)
    assert [r.prompt for r in requests] == [r.prompt for r in jobs(5)]  # seeded
    assert all(r.arrival_s == 0 for r in generate(WorkloadSpec(profile="service", num_requests=3), [], 0))


def test_jobs_are_awaited_with_the_long_poll() -> None:
    fake = FakeService(service_s=0.3)
    result = run_http(URL, jobs(3), poll_s=0.05, wait_s=7, concurrency=3, transport=fake.transport())
    assert all(r.status == "completed" for r in result.records)
    # One GET per job: the service answered it when the job ended.
    assert {job: [q for _, q in gets] for job, gets in fake.gets.items()} == {
        f"job-{i}": [{"wait": "7"}] for i in range(3)
    }


def test_a_service_that_ignores_wait_is_polled_at_the_poll_interval() -> None:
    fake = FakeService(service_s=0.3, honours_wait=False)
    result = run_http(URL, jobs(3), poll_s=0.05, concurrency=3, transport=fake.transport())
    assert all(r.status == "completed" for r in result.records)
    for gets in fake.gets.values():
        times = [t for t, _ in gets]
        assert 4 <= len(times) <= 9  # ~0.3 s / 0.05 s: polled, not hammered
        # The client spaces its looks from when it asked; the fake stamps when a look arrived, which a busy
        # machine delays by a varying amount (it saw 42 ms under the parallel suite). Hammering would be ~0.
        assert min(b - a for a, b in itertools.pairwise(times)) >= 0.025


def test_a_look_on_a_closed_connection_is_sent_again_once() -> None:
    fake = FakeService(broken_gets=1)
    result = run_http(URL, jobs(1), concurrency=1, transport=fake.transport())
    assert result.records[0].status == "completed" and len(fake.gets["job-0"]) == 2
    fake = FakeService(broken_gets=2)
    failed = run_http(URL, jobs(1), concurrency=1, transport=fake.transport()).records[0]
    assert (failed.status, failed.error_code) == ("failed", "ReadError")


async def test_lanes_spread_jobs_over_small_pools_and_keep_the_sampler_apart() -> None:
    async with Lanes(URL, "key", 3, 2, FakeService().transport()) as lanes:
        assert lanes.lane(0) is lanes.lane(3) and lanes.lane(1) is not lanes.lane(0)
        assert lanes.sampler not in {lanes.lane(i) for i in range(3)}
        assert lanes.lane(2).headers["Authorization"] == "Bearer key"


def test_plain_polls_when_wait_is_zero() -> None:
    fake = FakeService(service_s=0.1)
    run_http(URL, jobs(2), poll_s=0.02, wait_s=0, concurrency=2, transport=fake.transport())
    assert all(q == {} for gets in fake.gets.values() for _, q in gets)


def _refuse(body: dict[str, Any]) -> tuple[int, dict[str, Any] | str, dict[str, str]] | None:
    n = int(body["metadata"]["bench_request_id"].removeprefix("bench-"))
    if n % 4 == 1:
        error = {"code": "queue_full", "message": "queue interactive is full", "field": "queue"}
        return 429, {"error": error}, {"Retry-After": "2"}
    if n == 2:
        error = {"code": "invalid_request", "message": "prompt: must not contain NUL", "field": "prompt"}
        return 422, {"error": error}, {}
    if n == 6:
        return 503, "upstream down", {}
    return None


def test_a_refusal_is_reported_with_its_status_code_and_message() -> None:
    fake = FakeService(refuse=_refuse)
    result = run_http(URL, jobs(8), concurrency=2, transport=fake.transport())
    refused = {r.request_id: (r.submit_status, r.error_code, r.error) for r in result.records if r.refused}
    assert refused == {
        "bench-00001": (429, "queue_full", "queue interactive is full (Retry-After: 2)"),
        "bench-00005": (429, "queue_full", "queue interactive is full (Retry-After: 2)"),
        "bench-00002": (422, "invalid_request", "prompt: must not contain NUL"),
        "bench-00006": (503, "http_503", "upstream down"),
    }
    figures = service_figures(result)
    assert (figures["succeeded"], figures["refused"], figures["failed"]) == (4, 4, 0)
    assert figures["refused_by_code"] == {"queue_full": 2, "invalid_request": 1, "http_503": 1}
    assert figures["refusals"][0] == {
        "status": 429,
        "code": "queue_full",
        "message": "queue interactive is full (Retry-After: 2)",
        "count": 2,
        "examples": ["bench-00001", "bench-00005"],
    }
    notes = " | ".join(result.notes)
    assert "refused at submit, 2 job(s): HTTP 429 queue_full: queue interactive is full" in notes
    assert "HTTP 422 invalid_request: prompt: must not contain NUL (e.g. bench-00002)" in notes
    assert "rejected" not in notes
    assert "- refused 1x: HTTP 503 `http_503`: upstream down" in service_markdown(figures)


def test_service_options_are_checked(tmp_path: Path) -> None:
    out = ["--out", str(tmp_path), "--no-progress"]
    assert main(["--profile", "service", *out]) == 2  # the engine target
    assert main(["--target", "http", "--profile", "mixed", "--concurrency", "4", *out]) == 2
    service = ["--target", "http", "--profile", "service", *out]
    assert main([*service, "--concurrency", "4", "--submit-rate", "9"]) == 2
    assert main([*service, "--rate", "interactive=3"]) == 2
    assert main([*service, "--concurrency", "0"]) == 2


def test_service_profile_against_the_embedded_service(
    service_process: tuple[str, int], tmp_path: Path
) -> None:
    """The engineer's command lines, without --model: closed loop (measuring the server's CPU), then open
    loop (the server's processes not given: its CPU unknown)."""
    service, pid = service_process
    closed, opened = tmp_path / "closed", tmp_path / "open"
    common = ["--target", "http", "--url", service, "--profile", "service", "--timeout", "120"]
    common.append("--no-progress")
    measured = ["--server-pid", f"server={pid}"]
    assert main([*common, *measured, "--concurrency", "4", "-n", "12", "--out", str(closed)]) == 0
    assert main([*common, "--submit-rate", "20", "-n", "10", "--out", str(opened)]) == 0
    for out, n in ((closed, 12), (opened, 10)):
        report = json.loads((out / "report.json").read_text())
        figures = report["runs"]["http"]["service"]
        assert (figures["submitted"], figures["succeeded"], figures["refused"]) == (n, n, 0)
        assert figures["submit_latency_s"]["p99"] > 0 and figures["completions_per_s"] > 0
        assert figures["service_time_s"]["p50"] > 0
        assert report["runs"]["http"]["metrics"]["all"]["output_tokens"] == n  # one token each
        assert "Service figures" in (out / "report.md").read_text()
    params = json.loads((closed / "report.json").read_text())["inventory"]["parameters"]
    assert (params["concurrency"], params["wait_s"]) == (4, 30.0)
    _check_server_cpu(closed, pid, params)
    unknown = json.loads((opened / "report.json").read_text())["runs"]["http"]["service"]["server_cpu"]
    assert unknown["roles"] == {} and "server CPU unknown" in unknown["unknown"]
    assert "server CPU unknown" in (opened / "report.md").read_text()


def _check_server_cpu(out: Path, pid: int, params: dict[str, Any]) -> None:
    """The server's CPU per succeeded job, and where the server and the bench ran, in both reports."""
    service = json.loads((out / "report.json").read_text())["runs"]["http"]["service"]
    server = service["server_cpu"]["roles"]["server"]
    assert server["pid"] == pid and server["cpu_ms_per_job"] > 0 and server["jobs_per_s_per_core"] > 0
    assert params["server_pids"] == {"server": pid}
    # The inventory's plan is what the run did.
    assert all(service["pinning"][k] == v for k, v in params["cpu_pinning"].items())
    markdown = (out / "report.md").read_text()
    assert "| server | " in markdown and "CPU ms per job" in markdown
    if len(os.sched_getaffinity(0)) >= 2:
        split = params["cpu_pinning"]
        assert split["pinned"] and not set(split["server_cpus"]) & set(split["client_cpus"])
        assert service["pinning"]["errors"] == []
        assert f"CPU pinning: server on CPUs {split['server_cpus']} (server {pid})" in markdown
    else:
        assert "CPU pinning: not pinned" in markdown
