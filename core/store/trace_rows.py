"""The jobs a trace export reads (core/traces.py): every job created in a time window, oldest first, in
chunks, as plain rows of the columns a trace line needs.

Every status is read: a queued or running job arrived too, and a replay that left it out would offer less
load than the service was given (its output tokens are then unknown, null). Scheduled jobs not yet due are
read as well: they were submitted in the window.

Paged by keyset on (created_at, id) ascending, `chunk` rows per query, so the memory an export takes does
not grow with the store; each chunk is read in a short transaction of its own (nothing is held between
chunks). The text columns (prompt, messages, inputs) are read only when the export needs them
(`with_text`): to write them, or, without text, to hash prompts into prefix_blocks (core/traces.py
TraceExport.reads_prompts), which reads them and never writes them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Row, Select, and_, or_, select
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.lanes import LANE_SEPARATOR, lane_of
from conveyor.core.store.tables import Job

CHUNK_ROWS = 1000
TraceRow = Row[Any]  # a job as trace_rows reads it: the attributes named in SHAPE_COLUMNS (and TEXT_COLUMNS)

_TABLE = Job.__table__
# What a trace line is made of (core/traces.py trace_line); result_text is read to tell a tool call's answer.
SHAPE_COLUMNS = ("id", "tenant_id", "queue", "status", "kind", "params", "chat", "priority", "deadline_at",
                 "service_tier", "created_at", "run_at", "started_at", "first_token_at", "finished_at",
                 "prompt_tokens", "completion_tokens", "preemptions", "batch_id", "retries", "history",
                 "result_text")
TEXT_COLUMNS = ("prompt", "messages", "inputs")


@dataclass(frozen=True)
class TraceWindow:
    """Which jobs an export reads: created in [since, until), and optionally of one model (its lanes), one
    queue name (of every model) and one tenant."""

    since: datetime
    until: datetime
    model: str | None = None
    queue: str | None = None
    tenant: str | None = None

    def __post_init__(self) -> None:
        assert self.since.tzinfo is not None and self.until.tzinfo is not None, "store times are aware"
        assert self.since < self.until, (self.since, self.until)
        assert self.queue is None or LANE_SEPARATOR not in self.queue, self.queue


def trace_rows(session_factory: sessionmaker[Session], window: TraceWindow, *, with_text: bool = False,
               chunk: int = CHUNK_ROWS) -> Iterator[TraceRow]:
    """The window's jobs, oldest first by (created_at, id)."""
    assert chunk >= 1, chunk
    query = _window_query(window, with_text)
    after: tuple[datetime, str] | None = None
    while True:
        with session_factory() as session:
            rows = list(session.connection().execute(_after(query, after).limit(chunk)))
        yield from rows
        if len(rows) < chunk:
            return
        after = (rows[-1].created_at, rows[-1].id)


def _window_query(window: TraceWindow, with_text: bool) -> Select[Any]:
    names = SHAPE_COLUMNS + TEXT_COLUMNS if with_text else SHAPE_COLUMNS
    columns = [_TABLE.c[Job.__mapper__.attrs[name].columns[0].name].label(name) for name in names]
    query = select(*columns).where(_TABLE.c.created_at >= window.since, _TABLE.c.created_at < window.until)
    for condition in _lane_conditions(window.model, window.queue):
        query = query.where(condition)
    if window.tenant is not None:
        query = query.where(_TABLE.c.tenant_id == window.tenant)
    return query.order_by(_TABLE.c.created_at.asc(), _TABLE.c.id.asc())


def _lane_conditions(model: str | None, queue: str | None) -> list[Any]:
    """The `queue` column holds lanes, MODEL:QUEUE (core/lanes.py): a queue name holds no separator, so a
    lane's queue is what follows its last one, and its model all before it (a model id may hold some)."""
    lanes = _TABLE.c.queue
    if model is not None and queue is not None:
        return [lanes == lane_of(model, queue)]
    if queue is not None:
        return [lanes.endswith(LANE_SEPARATOR + queue, autoescape=True)]
    if model is not None:
        prefix = model + LANE_SEPARATOR
        # `llama3` is not the model of `llama3:8b:interactive`: after the prefix, no further separator.
        deeper = prefix.replace("/", "//").replace("%", "/%").replace("_", "/_") + "%" + LANE_SEPARATOR + "%"
        return [lanes.startswith(prefix, autoescape=True), lanes.not_like(deeper, escape="/")]
    return []


def _after(query: Select[Any], after: tuple[datetime, str] | None) -> Select[Any]:
    if after is None:
        return query
    created_at, job_id = after
    same_time_later_id = and_(_TABLE.c.created_at == created_at, _TABLE.c.id > job_id)
    later = or_(_TABLE.c.created_at > created_at, same_time_later_id)
    return query.where(later)
