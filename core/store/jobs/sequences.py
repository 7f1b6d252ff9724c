"""How many engine sequences a job runs at once: its choices for each of its prompts, or an embedding job's
inputs. The running set of an engine is counted in sequences (max_num_seqs), and so are a queue's room in a
worker (worker/queue_room.py) and a tenant's running share (core/store/fair_share.py): a job of 16 choices
holds 16 places, not one."""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Integer, case, func
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from conveyor.core.protocol.job_kinds import EMBEDDING
from conveyor.core.store.tables import Job


def sequences_of(kind: str, n: int, inputs: list[Any] | None) -> int:
    """A job's sequences (at least one), from its kind, its n (params) and its inputs."""
    count = len(inputs) if inputs else 1
    return max(1, count if kind == EMBEDDING else n * count)


def stored_n(params: dict[str, Any] | None) -> int:
    """A row's n as stored (core/protocol/job_params.py), 1 where it has none or no integer."""
    n = (params or {}).get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) else 1


def sequences_sql() -> ColumnElement[int]:
    """The same, in SQL (SQLite and PostgreSQL): for the store's sums over running jobs."""
    count = func.coalesce(JsonArrayLength(Job.inputs), 1)
    n = func.coalesce(Job.params["n"].as_integer(), 1)
    return case((Job.kind == EMBEDDING, count), else_=n * count).cast(Integer)


class JsonArrayLength(FunctionElement[int]):
    """A JSON column's array length, NULL for anything else: the column holds JSON `null` (not SQL NULL)
    where a job has no inputs, and PostgreSQL's json_array_length refuses a scalar."""

    type = Integer()
    inherit_cache = True


@compiles(JsonArrayLength, "postgresql")
def _json_array_length_postgresql(element: JsonArrayLength, compiler: SQLCompiler, **kw: Any) -> str:
    column = compiler.process(element.clauses, **kw)
    return f"CASE WHEN json_typeof({column}) = 'array' THEN json_array_length({column}) END"


@compiles(JsonArrayLength, "sqlite")
def _json_array_length_sqlite(element: JsonArrayLength, compiler: SQLCompiler, **kw: Any) -> str:
    column = compiler.process(element.clauses, **kw)
    return f"CASE WHEN json_type({column}) = 'array' THEN json_array_length({column}) END"
