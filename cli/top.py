"""`conveyor top`: queues, workers and engines in a terminal, refreshed like htop, read from the metrics.

Reads the API's /metrics (queues, job outcomes and latencies: the store's cluster-wide figures) and each
worker's metrics endpoint (`--worker URL`, repeatable; embedded, the API's /metrics has the engine's too).
Rates (jobs/s, tokens/s, preemptions/s) are the change since the previous frame; latency percentiles are
over every job the histograms hold. Goodput: "on time" is the share of the jobs with a deadline that ended
between the two frames (on the first frame, of all those counted) that succeeded by it, "on time/s" how many
did per second (conveyor_job_deadlines_total, every tier together).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

FINAL = ("succeeded", "failed", "cancelled", "expired")
DEADLINES = "conveyor_job_deadlines_total"
Samples = list[tuple[str, dict[str, str], float]]  # (sample name, labels, value)


@dataclass
class Source:
    """One metrics endpoint's samples at one moment, or why it could not be read."""

    url: str
    samples: Samples = field(default_factory=list)
    error: str | None = None

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples named `name` whose labels include `labels`."""
        return sum(
            v for n, ls, v in self.samples if n == name and all(ls.get(k) == x for k, x in labels.items())
        )

    def label_values(self, name: str, label: str) -> list[str]:
        return sorted({ls[label] for n, ls, _ in self.samples if n == name and label in ls})

    def lanes(self, name: str) -> list[dict[str, str]]:
        """The (model, queue) label pairs of `name`'s samples, as label filters for value()."""
        pairs = {(ls.get("model"), ls["queue"]) for n, ls, _ in self.samples if n == name and "queue" in ls}
        return [{"model": model, "queue": queue} if model is not None else {"queue": queue}
                for model, queue in sorted(pairs, key=lambda pair: (pair[0] or "", pair[1]))]

    def has(self, name: str) -> bool:
        return any(n == name for n, _, _ in self.samples)


@dataclass
class Frame:
    at: float
    api: Source
    workers: list[Source]

    def engines(self) -> list[Source]:
        """Every source with engine figures: the workers, or the API itself when embedded."""
        found = [w for w in self.workers if w.has("conveyor:kv_cache_usage_perc")]
        return found or ([self.api] if self.api.has("conveyor:kv_cache_usage_perc") else [])


def read(url: str, token: str | None) -> Source:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = httpx.get(f"{url.rstrip('/')}/metrics", headers=headers, timeout=5)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        return Source(url, error=str(exc) or type(exc).__name__)
    samples = [
        (s.name, dict(s.labels), s.value)
        for f in text_string_to_metric_families(response.text)
        for s in f.samples
    ]
    return Source(url, samples)


def take_frame(api_url: str, worker_urls: list[str], token: str | None) -> Frame:
    return Frame(time.monotonic(), read(api_url, token), [read(url, None) for url in worker_urls])


def quantile(source: Source, histogram: str, q: float, **labels: str) -> float | None:
    """The q-quantile of a histogram's cumulative buckets (interpolated within the bucket, as PromQL's
    histogram_quantile does); None when it is empty."""
    buckets: dict[float, float] = {}
    for name, ls, v in source.samples:
        if name == f"{histogram}_bucket" and all(ls.get(k) == x for k, x in labels.items()):
            bound = float(ls["le"])
            buckets[bound] = buckets.get(bound, 0.0) + v
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] == 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        if buckets[bound] >= rank:
            if bound == float("inf"):
                return lower
            share = (rank - below) / (buckets[bound] - below) if buckets[bound] > below else 1.0
            return lower + (bound - lower) * share
        lower, below = bound, buckets[bound]
    return lower


def rate(now: Frame, before: Frame | None, pick: Callable[[Frame], float]) -> float | None:
    """Per-second change of `pick(frame)` since the previous frame; None on the first one."""
    if before is None or now.at <= before.at:
        return None
    return max(0.0, (pick(now) - pick(before)) / (now.at - before.at))


def seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 120:
        return f"{value:.1f} s"
    return f"{value / 60:.1f} min" if value < 7200 else f"{value / 3600:.1f} h"


def per_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}/s"


def on_time_ratio(now: Frame, before: Frame | None, lane: dict[str, str]) -> float | None:
    """The share of the lane's (a model's queue) jobs with a deadline that ended since the previous frame (on
    the first frame: of every one counted) that succeeded by it; None when none ended."""
    def on_time(frame: Frame) -> float:
        return frame.api.value(DEADLINES, **lane, outcome="on_time")

    def ended(frame: Frame) -> float:
        return frame.api.value(DEADLINES, **lane)

    if before is None:
        on, all_ = on_time(now), ended(now)
    else:
        on, all_ = rate(now, before, on_time) or 0.0, rate(now, before, ended) or 0.0
    return on / all_ if all_ > 0 else None


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def queue_table(now: Frame, before: Frame | None) -> Table:
    api = now.api
    table = Table(title="Queues (API, cluster-wide)", title_justify="left")
    for column in (
        "model",
        "queue",
        "queued",
        "running",
        "scheduled",
        "oldest",
        "ttl",
        "workers",
        "done/s",
        "on time",
        "on time/s",
        "succeeded",
        "failed",
        "cancelled",
        "expired",
        "queue p95",
        "TTFT p95",
        "e2e p95",
    ):
        left = column in ("model", "queue")
        table.add_column(column, justify="left" if left else "right", no_wrap=left)
    for lane in api.lanes("conveyor_queue_depth"):
        ttl = api.value("conveyor_queue_default_ttl_seconds", **lane)
        done = rate(now, before, lambda f, la=lane: f.api.value("conveyor_job_outcomes_total", **la))
        on_time = rate(now, before, lambda f, la=lane: f.api.value(DEADLINES, **la, outcome="on_time"))
        outcomes = [f"{api.value('conveyor_job_outcomes_total', **lane, status=s):.0f}" for s in FINAL]
        table.add_row(
            lane.get("model", "-"),
            lane["queue"],
            f"{api.value('conveyor_queue_depth', **lane):.0f}",
            f"{api.value('conveyor_queue_running', **lane):.0f}",
            f"{api.value('conveyor_queue_scheduled', **lane):.0f}",
            seconds(api.value("conveyor_queue_oldest_age_seconds", **lane)),
            seconds(ttl) if ttl else "-",
            f"{api.value('conveyor_queue_workers', **lane):.0f}",
            per_s(done),
            percent(on_time_ratio(now, before, lane)),
            per_s(on_time),
            *outcomes,
            seconds(quantile(api, "conveyor_job_queue_time_seconds", 0.95, **lane)),
            seconds(quantile(api, "conveyor_job_time_to_first_token_seconds", 0.95, **lane)),
            seconds(quantile(api, "conveyor_job_e2e_seconds", 0.95, **lane, status="succeeded")),
        )
    return table


def engine_table(now: Frame, before: Frame | None) -> Table:
    table = Table(title="Engines (one row per worker)", title_justify="left")
    for column in (
        "worker",
        "KV used",
        "running",
        "waiting",
        "gen tok/s",
        "preempt/s",
        "preempted",
        "step p50",
        "tok/step p50",
        "prefix hits",
        "heartbeat",
        "ready after",
    ):
        table.add_column(column, justify="left" if column == "worker" else "right", no_wrap=True)
    for engine in now.engines():
        table.add_row(*_engine_row(engine, _previous(before, engine.url), now.at, before))
    return table


def _previous(before: Frame | None, url: str) -> Source | None:
    if before is None:
        return None
    return next((s for s in [before.api, *before.workers] if s.url == url), None)


def _engine_row(engine: Source, previous: Source | None, at: float, before: Frame | None) -> list[str]:
    def per_queue(name: str) -> str:
        return " ".join(
            f"{q[:3]}={engine.value(name, queue=q):.0f}" for q in engine.label_values(name, "queue")
        )

    def change(name: str) -> float | None:
        if previous is None or before is None or at <= before.at:
            return None
        return max(0.0, (engine.value(name) - previous.value(name)) / (at - before.at))

    hit_rate = engine.value("conveyor:prefix_cache_hit_rate")
    return [
        engine.url.split("://")[-1],
        f"{engine.value('conveyor:kv_cache_usage_perc') * 100:.0f}%",
        per_queue("conveyor:num_requests_running"),
        per_queue("conveyor:num_requests_waiting"),
        per_s(change("conveyor:generation_tokens_total")),
        per_s(change("conveyor:num_preemptions_total")),
        f"{engine.value('conveyor:num_preemptions_total'):.0f}",
        seconds(quantile(engine, "conveyor:engine_step_duration_seconds", 0.5)),
        _number(quantile(engine, "conveyor:iteration_tokens_total", 0.5)),
        f"{hit_rate * 100:.0f}%",
        seconds(engine.value("conveyor:heartbeat_age_seconds")),
        seconds(engine.value("conveyor:cold_start_seconds", phase="engine_ready")),
    ]


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def render(now: Frame, before: Frame | None) -> RenderableType:
    errors = [Text(f"{s.url}: {s.error}", style="red") for s in [now.api, *now.workers] if s.error]
    header = Text(f"conveyor top  {time.strftime('%H:%M:%S')}  api {now.api.url}", style="bold")
    return Group(header, *errors, queue_table(now, before), engine_table(now, before))


def run_top(
    api_url: str,
    worker_urls: list[str],
    token: str | None,
    interval_s: float,
    once: bool,
    console: Console | None = None,
) -> None:
    """Refreshes every interval_s until Ctrl-C; `once`: takes two frames interval_s apart (so rates show),
    prints the second, and returns."""
    console = console or Console()
    before = take_frame(api_url, worker_urls, token)
    if once:
        time.sleep(interval_s)
        console.print(render(take_frame(api_url, worker_urls, token), before))
        return
    with Live(render(before, None), console=console, refresh_per_second=4, screen=False) as live:
        try:
            while True:
                time.sleep(interval_s)
                now = take_frame(api_url, worker_urls, token)
                live.update(render(now, before))
                before = now
        except KeyboardInterrupt:
            return
