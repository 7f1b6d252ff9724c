"""Terminal output: a progress bar per run and a rich summary table."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from conveyor.bench.report import SERVICE_COLUMNS, fmt, pinning_text, service_cells


@contextmanager
def progress_bar(
    console: Console, label: str, total: int, enabled: bool, refresh_hz: float = 10
) -> Iterator[Callable[[int], None]]:
    """Yields `advance(n)`; a no-op when disabled (tests, non-interactive runs). `advance` only counts; the
    bar is redrawn `refresh_hz` times a second (low when the bench shares the CPUs with a server)."""
    if not enabled:
        yield lambda n: None
        return
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        refresh_per_second=refresh_hz,
    ) as progress:
        task = progress.add_task(label, total=total)
        yield lambda n: progress.advance(task, n)


def summary_table(title: str, runs: dict[str, dict[str, Any]]) -> Table:
    """One row per (run, group): counts, p90 latencies, throughput, memory."""
    table = Table(title=title)
    for col in (
        "run",
        "group",
        "done/sub",
        "cancel",
        "fail",
        "TTFT p90",
        "ITL p90",
        "e2e p90",
        "in deadline",
        "out tok/s",
        "preempt",
        "peak KV",
        "KV waste",
        "peak run",
    ):
        table.add_column(col, justify="right" if col not in ("run", "group") else "left")
    for name, run in runs.items():
        for group, m in run["metrics"].items():
            table.add_row(
                name,
                group,
                f"{m['completed']}/{m['submitted']}",
                str(m["cancelled"]),
                str(m["failed"]),
                fmt(m["ttft_s"]["p90"]),
                fmt(m["itl_s"]["p90"]),
                fmt(m["e2e_s"]["p90"]),
                fmt(m["deadline_attainment"], share=True),
                fmt(m["output_tokens_per_s"]),
                str(m["preemptions"]),
                fmt(m["peak_kv_usage"], share=True),
                fmt(m["kv_waste"], share=True),
                fmt(m["peak_running"]),
            )
    return table


def service_table(title: str, runs: dict[str, dict[str, Any]]) -> Table:
    """One row per HTTP run: the service figures (bench/service.py), latencies in milliseconds."""
    table = Table(title=title)
    for col in SERVICE_COLUMNS:
        table.add_column(col, justify="left" if col == "run" else "right")
    for name, run in runs.items():
        if "service" in run:
            table.add_row(name, *service_cells(run["service"]))
    return table


def refusal_lines(runs: dict[str, dict[str, Any]]) -> list[str]:
    """A line per kind of refusal: HTTP status, error code, message, how many."""
    return [
        f"{name}: refused {k['count']}x: HTTP {k['status']} {k['code']}: {k['message']}"
        for name, run in runs.items()
        for k in run.get("service", {}).get("refusals", [])
    ]



def server_lines(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Per HTTP run: where the server and the bench ran, and the server's CPU per role (or why unknown)."""
    lines = []
    for name, run in runs.items():
        service = run.get("service")
        if not service:
            continue
        cpu = service.get("server_cpu") or {}
        lines.append(f"{name}: CPU pinning: {pinning_text(service.get('pinning'))}")
        lines += [f"{name}: {cpu['unknown']}"] if cpu.get("unknown") else []
        for role, r in (cpu.get("roles") or {}).items():
            lines.append(
                f"{name}: server CPU, {role}: {fmt(r['cpu_s'])} s, {fmt(r['cpu_ms_per_job'])} ms per job, "
                f"{fmt(r['cores_used'])} cores used, {fmt(r['jobs_per_s_per_core'])} jobs/s per core"
            )
    return lines
