"""`conveyor bench-store`: what each store operation costs as the stored work grows (issue 32).

For each scale (`--scale 1k:0,100k:0,100k:1M`: queued jobs in one queue : finished jobs kept), the bench
empties and fills a PostgreSQL database with plain SQL bulk inserts shaped like real rows (cli/store_fill.py),
then times every per-job and per-round store operation through the project's own functions
(cli/store_operations.py), each `--repeat` times after one untimed run, and prints the median and p90 in ms,
one column per scale. `--explain` also prints, per operation, whether PostgreSQL's plan of any statement it
ran reads the jobs table sequentially (cli/store_plans.py). `--out FILE` writes everything as JSON.

The database is one this bench creates on `--server` and drops at the end (`--keep` keeps it), or the one
`--database-url` names, which it empties: it refuses a database holding jobs of other tenants than its own.
It lives here rather than in bench/ because it calls the store itself, which bench/ may not import (bench/
talks to a service over HTTP only).
"""

from __future__ import annotations

import json
import math
import secrets
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url

from conveyor.cli.store_fill import TENANT_PREFIX, fill, foreign_rows
from conveyor.cli.store_operations import OPERATIONS, RETENTION_DAYS, Bench, Operation, open_bench
from conveyor.cli.store_plans import ExplainedStatement, Statement, captured_statements, explain_statements
from conveyor.core.clock import utcnow
from conveyor.core.lanes import lane_of
from conveyor.core.settings import Settings
from conveyor.core.store.database import make_db_engine, make_session_factory
from conveyor.core.store.migrate import upgrade

DEFAULT_SCALES = "1k:0,100k:0,100k:1M"
DEFAULT_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
SUFFIXES = {"k": 1_000, "K": 1_000, "m": 1_000_000, "M": 1_000_000}
DEFAULT_QUEUED, DEFAULT_HISTORY = 100_000, 1_000_000  # --queued, --history
MIN_QUEUED = 100  # the operations set aside 40 queued jobs of their own


@dataclass(frozen=True)
class Scale:
    label: str  # as given: "100k:1M"
    queued: int
    history: int


@dataclass(frozen=True)
class StoreBenchArgs:
    scales: list[Scale]
    tenants: int = 10
    repeat: int = 20
    queue: str = "interactive"
    database_url: str | None = None
    server: str = DEFAULT_SERVER
    keep: bool = False
    explain: bool = False
    out: Path | None = None


@dataclass
class Timing:
    runs_ms: list[float]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.runs_ms)

    @property
    def p90_ms(self) -> float:
        ordered = sorted(self.runs_ms)
        return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]  # nearest rank


@dataclass
class ScaleResult:
    scale: Scale
    fill_s: float
    timings: dict[str, Timing] = field(default_factory=dict)  # operation name -> timing
    plans: dict[str, list[ExplainedStatement]] = field(default_factory=dict)  # with --explain


def parse_count(text: str) -> int:
    """"1k" -> 1000, "1M" -> 1000000, "250" -> 250."""
    text = text.strip()
    factor = SUFFIXES.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in SUFFIXES else text
    try:
        value = float(number) * factor
    except ValueError:
        raise ValueError(f"{text!r}: not a count (like 200, 1k, 1M)") from None
    if value < 0 or value != int(value):
        raise ValueError(f"{text!r}: not a whole count")
    return int(value)


def parse_scales(text: str) -> list[Scale]:
    """"1k:0,100k:1M" -> scales (queued:history), each with at least MIN_QUEUED queued jobs."""
    scales = []
    for item in text.split(","):
        queued, sep, history = item.strip().partition(":")
        if not sep:
            raise ValueError(f"--scale {item!r}: give QUEUED:HISTORY, like 100k:1M")
        scale = Scale(item.strip(), parse_count(queued), parse_count(history))
        if scale.queued < MIN_QUEUED:
            raise ValueError(f"--scale {item!r}: at least {MIN_QUEUED} queued jobs")
        scales.append(scale)
    return scales


def options_args(scale: str, queued: int | None, history: int | None, *, server: str | None,
                 **options: Any) -> StoreBenchArgs:
    """The command's options as arguments: --queued/--history (either) make one scale instead of --scale."""
    if queued is not None or history is not None:
        queued = DEFAULT_QUEUED if queued is None else queued
        history = DEFAULT_HISTORY if history is None else history
        scale = f"{queued}:{history}"
    return StoreBenchArgs(parse_scales(scale), server=server or DEFAULT_SERVER, **options)


# --- running ---------------------------------------------------------------------------------------------


def run_store_bench(args: StoreBenchArgs, console: Console | None = None) -> list[ScaleResult]:
    console = console or Console(width=200)
    results = []
    with _database(args, console) as url:
        db_engine = make_db_engine(url)
        try:
            for scale in args.scales:
                results.append(bench_scale(db_engine, url, scale, args, console))
        finally:
            db_engine.dispose()
    console.print(timings_table(results))
    if args.explain:
        console.print(seq_scan_table(results))
        print_seq_scans(results[-1], console)
    if args.out is not None:
        args.out.write_text(json.dumps(report_json(results, args), indent=2) + "\n")
        console.print(f"wrote {args.out}")
    return results


def bench_scale(db_engine: Engine, url: str, scale: Scale, args: StoreBenchArgs,
                console: Console) -> ScaleResult:
    """Fills the database for one scale, then times (and with --explain, explains) every operation."""
    console.print(f"[bold]{scale.label}[/bold]: {scale.queued} queued, {scale.history} finished, "
                  f"{args.tenants} tenants")
    settings = Settings(database_url=url, retention_days=RETENTION_DAYS)
    lane = lane_of(settings.default_model_id(), args.queue)  # the store keeps lanes (core/lanes.py)
    fill_s = fill(db_engine, queued=scale.queued, history=scale.history, tenants=args.tenants,
                  queue=lane, now=utcnow(), progress=lambda line: console.print(f"  {line}"))
    console.print(f"  filled in {fill_s:.1f} s")
    sessions = make_session_factory(db_engine)
    bench = open_bench(db_engine, sessions, settings, lane, f"{TENANT_PREFIX}000")
    result = ScaleResult(scale, fill_s)
    filled = status_counts(db_engine)
    for operation in OPERATIONS:
        statements = run_captured(bench, operation)  # also the untimed warm-up run
        if args.explain:
            result.plans[operation.name] = explain_statements(db_engine, statements)
        result.timings[operation.name] = time_operation(bench, operation, args.repeat)
    if status_counts(db_engine) != filled:
        raise RuntimeError(f"the operations left the jobs changed: {filled} -> {status_counts(db_engine)}")
    return result


def run_once(bench: Bench, operation: Operation) -> float:
    """One run: prepared and undone untimed; returns the ms the run itself took."""
    prepared = operation.prepare(bench) if operation.prepare is not None else None
    start = time.perf_counter()
    outcome = operation.run(bench, prepared)
    elapsed_ms = (time.perf_counter() - start) * 1000
    if operation.undo is not None:
        operation.undo(bench, prepared, outcome)
    return elapsed_ms


def run_captured(bench: Bench, operation: Operation) -> list[Statement]:
    """One untimed run, returning the statements it sent (its preparation and undoing left out)."""
    prepared = operation.prepare(bench) if operation.prepare is not None else None
    with captured_statements(bench.db_engine) as statements:
        outcome = operation.run(bench, prepared)
    if operation.undo is not None:
        operation.undo(bench, prepared, outcome)
    return statements


def time_operation(bench: Bench, operation: Operation, repeat: int) -> Timing:
    return Timing([run_once(bench, operation) for _ in range(repeat)])


def status_counts(db_engine: Engine) -> dict[str, int]:
    """Jobs per status: the same after the timings as after the fill, or an operation was not undone."""
    with db_engine.connect() as conn:
        rows = conn.execute(text("SELECT status, count(*) FROM jobs GROUP BY status")).all()
    return {status: int(n) for status, n in rows}


@contextmanager
def _database(args: StoreBenchArgs, console: Console) -> Iterator[str]:
    """The database to fill, migrated: --database-url (checked), or a new one on --server (dropped after,
    unless --keep)."""
    if args.database_url is not None:
        _check_postgres(args.database_url)
        _refuse_foreign_rows(args.database_url)  # before migrating it: a database not meant for the bench
        console.print(upgrade(args.database_url).describe())
        yield args.database_url
        return
    _check_postgres(args.server)
    name = "conveyor_bench_" + secrets.token_hex(4)
    url = make_url(args.server).set(database=name).render_as_string(hide_password=False)
    _admin(args.server, f'CREATE DATABASE "{name}"')
    try:
        console.print(upgrade(url).describe())
        yield url
    finally:
        if args.keep:
            console.print(f"kept the database: {url}")
        else:
            _admin(args.server, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _check_postgres(url: str) -> None:
    if make_url(url).get_backend_name() != "postgresql":
        raise ValueError(f"{make_url(url).get_backend_name()}: the store bench runs on PostgreSQL only")


def _refuse_foreign_rows(url: str) -> None:
    db_engine = make_db_engine(url)
    try:
        if foreign_rows(db_engine):
            raise ValueError(f"--database-url: the database holds jobs of tenants other than the bench's "
                             f"({TENANT_PREFIX}...); the bench empties its tables: give it a throwaway one")
    finally:
        db_engine.dispose()


def _admin(server: str, statement: str) -> None:
    db_engine = make_db_engine(server, isolation_level="AUTOCOMMIT")
    try:
        with db_engine.connect() as conn:
            conn.execute(text(statement))
    finally:
        db_engine.dispose()


# --- reporting -------------------------------------------------------------------------------------------


def timings_table(results: list[ScaleResult]) -> Table:
    table = Table("operation", "path", *(f"{r.scale.label}" for r in results),
                  title="Store operations: median / p90 ms (columns: queued:history)", title_justify="left")
    for operation in OPERATIONS:
        cells = [_cell(r.timings[operation.name]) for r in results]
        table.add_row(operation.name, operation.path, *cells)
    table.add_row("fill (inserts + VACUUM ANALYZE), s", "", *(f"{r.fill_s:.1f}" for r in results))
    return table


def _cell(timing: Timing) -> str:
    return f"{_ms(timing.median_ms)} / {_ms(timing.p90_ms)}"


def _ms(value: float) -> str:
    return f"{value:.2f}" if value < 10 else f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def seq_scan_table(results: list[ScaleResult]) -> Table:
    table = Table("operation", *(r.scale.label for r in results),
                  title="Seq Scan on jobs in the plans? (statements with one / explained)",
                  title_justify="left")
    for operation in OPERATIONS:
        table.add_row(operation.name, *(_scan_cell(r.plans.get(operation.name, [])) for r in results))
    return table


def _scan_cell(explained: list[ExplainedStatement]) -> str:
    scanning = sum(1 for e in explained if e.seq_scans)
    return f"{'yes' if scanning else 'no'} ({scanning}/{len(explained)})"


def print_seq_scans(result: ScaleResult, console: Console) -> None:
    """At one scale: each statement whose plan reads jobs sequentially, with the scan."""
    console.print(f"[bold]Statements reading jobs sequentially at {result.scale.label}[/bold]")
    for name, explained in result.plans.items():
        for e in explained:
            for scan in e.seq_scans:
                console.print(f"- {name}: {e.statement.head()}\n    {scan}", highlight=False, soft_wrap=True)


def report_json(results: list[ScaleResult], args: StoreBenchArgs) -> dict[str, Any]:
    return {
        "command": " ".join(["conveyor", *sys.argv[1:]]),
        "tenants": args.tenants, "repeat": args.repeat, "queue": args.queue,
        "scales": [{**asdict(r.scale), "fill_s": round(r.fill_s, 2)} for r in results],
        "operations": [_operation_json(operation, results) for operation in OPERATIONS],
    }


def _operation_json(operation: Operation, results: list[ScaleResult]) -> dict[str, Any]:
    out: dict[str, Any] = {"name": operation.name, "path": operation.path, "timings": {}, "seq_scans": {}}
    for r in results:
        timing = r.timings[operation.name]
        out["timings"][r.scale.label] = {"median_ms": round(timing.median_ms, 3),
                                         "p90_ms": round(timing.p90_ms, 3),
                                         "runs_ms": [round(ms, 3) for ms in timing.runs_ms]}
        if operation.name in r.plans:
            out["seq_scans"][r.scale.label] = [
                {"statement": e.statement.head(200), "scans": e.seq_scans, "reads": e.scans}
                for e in r.plans[operation.name]]
    return out
