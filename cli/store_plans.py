"""What PostgreSQL plans for the statements an operation runs: capture them while it runs, EXPLAIN each with
the parameters it ran with, and find the scans of a table in the plans.

    with captured_statements(db_engine) as statements:
        claim_fair(...)
    for explained in explain_statements(db_engine, statements):
        assert not explained.seq_scans, explained

Used by `conveyor bench-store --explain` (cli/store_bench.py), and by tests asserting that no per-job or
per-round path reads the jobs table sequentially.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, event

EXPLAINABLE = ("SELECT", "INSERT", "UPDATE", "DELETE", "WITH")  # what EXPLAIN takes; not SET, not VACUUM
SCAN_TYPES = ("Seq Scan", "Index Scan", "Index Only Scan", "Bitmap Heap Scan", "Tid Scan")


@dataclass(frozen=True)
class Statement:
    """One statement as the driver received it: its SQL (driver placeholders) and its parameters."""

    sql: str
    params: Any  # a dict (named placeholders) or a sequence; the first set of an executemany

    @property
    def explainable(self) -> bool:
        return self.sql.lstrip().upper().startswith(EXPLAINABLE)

    def head(self, width: int = 100) -> str:
        """The SQL on one line, cut to `width` characters."""
        flat = " ".join(self.sql.split())
        return flat if len(flat) <= width else flat[: width - 1] + "…"


@dataclass(frozen=True)
class ExplainedStatement:
    statement: Statement
    plan: Any  # EXPLAIN (FORMAT JSON)'s document
    seq_scans: list[str]  # the plan's sequential scans of the table asked about (`seq_scans`)
    scans: list[str]  # every scan of that table (`table_scans`)


@contextmanager
def captured_statements(db_engine: Engine) -> Iterator[list[Statement]]:
    """Every statement sent through `db_engine`'s connections while the block runs, in order (a SQLAlchemy
    `before_cursor_execute` listener, removed on exit)."""
    statements: list[Statement] = []

    def capture(_conn: Any, _cursor: Any, sql: str, params: Any, _context: Any, executemany: bool) -> None:
        if executemany and params:
            params = params[0]
        statements.append(Statement(sql, params))

    event.listen(db_engine, "before_cursor_execute", capture)
    try:
        yield statements
    finally:
        event.remove(db_engine, "before_cursor_execute", capture)


def explain(conn: Connection, statement: Statement) -> Any:
    """EXPLAIN (FORMAT JSON) of the statement with its parameters: the plan, not run (no ANALYZE)."""
    return conn.exec_driver_sql("EXPLAIN (FORMAT JSON) " + statement.sql, statement.params).scalar_one()


def explain_statements(db_engine: Engine, statements: list[Statement], table: str = "jobs",
                       ) -> list[ExplainedStatement]:
    """Each explainable statement's plan and its scans of `table`, in one transaction rolled back."""
    explained = []
    with db_engine.connect() as conn:
        for statement in statements:
            if statement.explainable:
                plan = explain(conn, statement)
                explained.append(ExplainedStatement(statement, plan, seq_scans(plan, table),
                                                     table_scans(plan, table)))
        conn.rollback()
    return explained


def plan_nodes(plan: Any) -> Iterator[dict[str, Any]]:
    """Every node of an EXPLAIN (FORMAT JSON) document, depth first: the top plans, their children, init
    plans and subplans (all under "Plans")."""
    if isinstance(plan, list):
        for item in plan:
            yield from plan_nodes(item)
    elif isinstance(plan, dict):
        if "Node Type" in plan:
            yield plan
        for key in ("Plan", "Plans"):
            if key in plan:
                yield from plan_nodes(plan[key])


def seq_scans(plan: Any, table: str = "jobs") -> list[str]:
    """The sequential scans of `table` in the plan, described (parallel or not, the filter, the rows the
    planner expects); empty when the plan reads `table` only through indexes, or not at all."""
    return [describe_scan(node) for node in plan_nodes(plan)
            if node.get("Node Type") == "Seq Scan" and node.get("Relation Name") == table]


def table_scans(plan: Any, table: str = "jobs") -> list[str]:
    """Every scan of `table` in the plan, described: how each statement reads it."""
    return [describe_scan(node) for node in plan_nodes(plan)
            if node.get("Node Type") in SCAN_TYPES and node.get("Relation Name") == table]


def describe_scan(node: dict[str, Any]) -> str:
    """"Seq Scan on jobs (parallel), filter: ..., ~86432 rows"; an index scan names its index (a bitmap scan
    the indexes under it)."""
    kind = ("Parallel " if node.get("Parallel Aware") else "") + str(node.get("Node Type"))
    indexes = [node["Index Name"]] if "Index Name" in node else [
        child["Index Name"] for child in plan_nodes(node.get("Plans", [])) if "Index Name" in child]
    text = f"{kind} on {node.get('Relation Name')}" + (f" using {', '.join(indexes)}" if indexes else "")
    condition = node.get("Index Cond") or node.get("Recheck Cond")
    if condition:
        text += f", cond {condition}"
    if node.get("Filter"):
        text += f", filter {node['Filter']}"
    return text + f", ~{node.get('Plan Rows', '?')} rows"
