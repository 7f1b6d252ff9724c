"""`conveyor bench-store` (issue 32): it fills a throwaway PostgreSQL database, times every store operation
and prints them all with figures; `--explain` finds the sequential scans of jobs in the plans; a database
holding other jobs is refused. No timing is asserted: only that each operation ran and was reported."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import make_url
from typer.testing import CliRunner

from conveyor.cli.main import app
from conveyor.cli.store_bench import parse_count, parse_scales
from conveyor.cli.store_operations import OPERATIONS
from conveyor.cli.store_plans import Statement, plan_nodes, seq_scans, table_scans
from conveyor.core.clock import utcnow
from conveyor.core.store import jobs
from conveyor.core.store.database import make_db_engine, make_session_factory
from conveyor.core.store.migrate import upgrade

runner = CliRunner()
FIGURES = re.compile(r"\d+(\.\d+)? / \d+(\.\d+)?")


def test_it_times_and_explains_every_operation_and_drops_its_database(
    fresh_postgres_url: str, tmp_path: Path,
) -> None:
    out = tmp_path / "store.json"
    done = runner.invoke(app, ["bench-store", "--scale", "200:1000", "--repeat", "2", "--server",
                               fresh_postgres_url, "--explain", "--out", str(out)])

    assert done.exit_code == 0, done.output
    lines = done.output.splitlines()
    for operation in OPERATIONS:
        row = [line for line in lines if operation.name in line and FIGURES.search(line)]
        assert row, f"{operation.name}: no row with median / p90 in\n{done.output}"
    report = json.loads(out.read_text())
    assert [s["label"] for s in report["scales"]] == ["200:1000"]
    assert {o["name"] for o in report["operations"]} == {operation.name for operation in OPERATIONS}
    for operation in report["operations"]:
        timing = operation["timings"]["200:1000"]
        assert len(timing["runs_ms"]) == 2 and timing["median_ms"] >= 0, operation
        assert "200:1000" in operation["seq_scans"], operation["name"]  # --explain: every operation's plans
    got = next(o for o in report["operations"] if o["name"].startswith("get job"))
    assert any(entry["reads"] for entry in got["seq_scans"]["200:1000"]), "--explain names jobs' reads"
    for name in ("count_queued", "count_scheduled_in", "republish"):  # the tallies; the walk's index range
        explained = [o for o in report["operations"] if o["name"].startswith(name)]
        assert explained, name
        for operation in explained:
            reads = [read for entry in operation["seq_scans"]["200:1000"] for read in entry["reads"]]
            assert all("Index" in read for read in reads), (operation["name"], reads)
            assert bool(reads) == (name == "republish"), (operation["name"], reads)
    # With a history five times the backlog, no per-job or per-round path reads the jobs table sequentially
    # (before migration 0014: the /metrics totals, the goodput counts and the forecast's rate did).
    seq_scanned = {o["name"]: [e["scans"] for e in o["seq_scans"]["200:1000"] if e["scans"]]
                   for o in report["operations"]}
    assert not {name: scans for name, scans in seq_scanned.items() if scans}
    created = re.search(r"/(conveyor_bench_[0-9a-f]+)", done.output)
    assert created is not None, done.output
    assert not _database_exists(fresh_postgres_url, created.group(1)), "the bench's database was left behind"


def test_a_database_holding_other_jobs_is_refused(fresh_postgres_url: str) -> None:
    upgrade(fresh_postgres_url)
    db_engine = make_db_engine(fresh_postgres_url)
    with make_session_factory(db_engine)() as session:
        jobs.add(session, jobs.NewJob(tenant_id="default", queue="interactive", prompt="x", messages=None,
                                      params={}, meta=None, webhook=None, idempotency_key=None,
                                      request_hash="h", prompt_tokens=1, ttl_s=None, timeout_s=None),
                 utcnow())
    db_engine.dispose()

    done = runner.invoke(app, ["bench-store", "--scale", "200:0", "--database-url", fresh_postgres_url])

    assert done.exit_code == 2
    assert "tenants other than the bench's" in done.output
    with psycopg.connect(_dsn(fresh_postgres_url)) as conn:
        assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (1,), "the job must be left alone"


def test_scales_and_counts_parse() -> None:
    assert [(s.label, s.queued, s.history) for s in parse_scales("1k:0, 100k:1M,250:2.5k")] == [
        ("1k:0", 1000, 0), ("100k:1M", 100_000, 1_000_000), ("250:2.5k", 250, 2500)]
    assert parse_count("42") == 42
    for bad in ("1k", "10:0", "x:1", "1k:1.5"):  # no history; too few queued; not a count; not whole
        with pytest.raises(ValueError):
            parse_scales(bad)


# EXPLAIN (FORMAT JSON) as PostgreSQL writes it: a list of one document whose "Plan" nests "Plans".
NESTED_SEQ_SCAN: list[dict[str, Any]] = [{"Plan": {
    "Node Type": "Aggregate", "Plans": [{
        "Node Type": "Nested Loop", "Plans": [
            {"Node Type": "Index Scan", "Relation Name": "tenants", "Index Name": "tenants_pkey",
             "Plan Rows": 1},
            {"Node Type": "Gather", "Plans": [{
                "Node Type": "Seq Scan", "Parallel Aware": True, "Relation Name": "jobs",
                "Filter": "((status)::text = 'queued'::text)", "Plan Rows": 86432}]},
            {"Node Type": "Seq Scan", "Subplan Name": "InitPlan 1", "Relation Name": "workers",
             "Plan Rows": 3},
        ]}]}}]
INDEX_ONLY: list[dict[str, Any]] = [{"Plan": {
    "Node Type": "Limit", "Plans": [{
        "Node Type": "LockRows", "Plans": [{
            "Node Type": "Bitmap Heap Scan", "Relation Name": "jobs", "Recheck Cond": "(tenant_id = 'a')",
            "Plan Rows": 12, "Plans": [{
                "Node Type": "Bitmap Index Scan", "Index Name": "ix_jobs_tenant_created",
                "Index Cond": "(tenant_id = 'a')"}]}]}]}}]


def test_a_seq_scan_of_jobs_deep_in_a_plan_is_found() -> None:
    found = seq_scans(NESTED_SEQ_SCAN)

    assert len(found) == 1
    assert found[0].startswith("Parallel Seq Scan on jobs") and "queued" in found[0] and "86432" in found[0]
    assert seq_scans(NESTED_SEQ_SCAN, "workers") == ["Seq Scan on workers, ~3 rows"]
    assert [node["Node Type"] for node in plan_nodes(NESTED_SEQ_SCAN)] == [
        "Aggregate", "Nested Loop", "Index Scan", "Gather", "Seq Scan", "Seq Scan"]


def test_a_plan_reading_jobs_through_an_index_has_no_seq_scan() -> None:
    assert seq_scans(INDEX_ONLY) == []
    assert table_scans(INDEX_ONLY) == [
        "Bitmap Heap Scan on jobs using ix_jobs_tenant_created, cond (tenant_id = 'a'), ~12 rows"]
    assert seq_scans([]) == [] and seq_scans({"Plan": {"Node Type": "Result"}}) == []


def test_statements_know_what_explain_takes() -> None:
    assert Statement("  select 1", {}).explainable
    assert Statement("WITH x AS (SELECT 1) SELECT 1", {}).explainable
    assert not Statement("SET LOCAL idle_in_transaction_session_timeout = 5000", {}).explainable
    assert Statement("SELECT\n   a,   b FROM jobs", {}).head(12) == "SELECT a, b…"


def _dsn(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _database_exists(server_url: str, name: str) -> bool:
    with psycopg.connect(_dsn(server_url)) as conn:
        return conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is not None
