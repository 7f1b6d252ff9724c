"""Admin: `GET /v1/admin/trace`, the jobs of a time window as a trace (core/traces.py): a header line, then
one JSON line per job, shapes only; with `with_text=true` the prompts and outputs too. What
`conveyor trace export` writes to its file.

Only an admin may export (api/auth.py admin_caller): a trace holds every tenant's traffic, and names tenants
only by keyed hash. The lines are written to a spooled file as the store is read, in chunks, and streamed
once all are read: the header, first, counts them. Each job's prompt is tokenized by its model's tokenizer
(the one submit counts with) and hashed into prefix_blocks (core/trace_prefixes.py); its text is not written
unless asked for.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from typing import IO, Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from conveyor.api.auth import AdminCaller
from conveyor.api.deps import ServicesDep
from conveyor.api.errors import ApiError
from conveyor.api.schemas.errors import error_responses
from conveyor.core.clock import utcnow
from conveyor.core.lanes import LANE_SEPARATOR
from conveyor.core.protocol.request_rules import text_problem
from conveyor.core.settings import Settings
from conveyor.core.store.trace_rows import TraceWindow, trace_rows
from conveyor.core.trace_prefixes import prompt_ids_by_model
from conveyor.core.trace_window import window_bounds
from conveyor.core.traces import TraceExport, header_line, trace_header, write_lines

TRACE_PATH = "/v1/admin/trace"
MEDIA_TYPE = "application/x-ndjson"
SPOOL_BYTES = 8 << 20  # lines are kept in memory up to this, then in a temporary file
READ_BYTES = 1 << 16

router = APIRouter(tags=["admin"], dependencies=[AdminCaller])

SinceQuery = Annotated[str, Query(max_length=64, description="the window's start: a duration ago (`90s`, "
                                  "`30m`, `1h`, `2d`) or an ISO 8601 time")]
UntilQuery = Annotated[str | None, Query(max_length=64, description="the window's end (excluded), in either "
                                         "form; unset = now")]
ModelQuery = Annotated[str | None, Query(min_length=1, max_length=128,
                                         description="this served model's jobs only")]
QueueQuery = Annotated[str | None, Query(min_length=1, max_length=64,
                                         description="this queue's jobs only (of every model)")]
TenantQuery = Annotated[str | None, Query(min_length=1, max_length=64,
                                          description="this tenant's jobs only (named by its hash)")]
WithTextQuery = Annotated[bool, Query(description="add each job's prompt, messages or inputs and its output")]

RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "the trace: a header line (`conveyor_trace`), then one JSON line per job, in "
                         "arrival order",
          "content": {MEDIA_TYPE: {"schema": {"type": "string"}}}},
    **error_responses(401, 403, 404, 422),
}


@router.get(TRACE_PATH, response_class=StreamingResponse, responses=RESPONSES)
def export_trace(services: ServicesDep, since: SinceQuery, until: UntilQuery = None, model: ModelQuery = None,
                 queue: QueueQuery = None, tenant: TenantQuery = None,
                 with_text: WithTextQuery = False) -> StreamingResponse:
    """The jobs created in [since, until), of every status (queued and running ones arrived too), as a
    trace; an admin API key or the admin token (or auth off) only."""
    settings = services.settings
    window = _window(settings, since, until, model, queue, tenant)
    tokenizers = {model.id: model.tokenizer for model in services.models}  # base models: their lanes' ids
    export = TraceExport.of(settings, window, with_text, prompt_ids_by_model(tokenizers))
    spool: IO[bytes] = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)  # noqa: SIM115 (closed by _chunks)
    try:
        rows = trace_rows(services.session_factory, window, with_text=export.reads_prompts)
        jobs = write_lines(rows, export, spool)
    except BaseException:
        spool.close()
        raise
    header = header_line(trace_header(settings, export, jobs, utcnow()))
    return StreamingResponse(_chunks(header, spool), media_type=MEDIA_TYPE)


def _window(settings: Settings, since: str, until: str | None, model: str | None, queue: str | None,
            tenant: str | None) -> TraceWindow:
    """The export's window; 422 naming the field for a bad time or filter, 404 for a model not served."""
    try:
        start, end = window_bounds(since, until, utcnow())
    except ValueError as exc:
        field = str(exc).partition(":")[0]
        raise ApiError(422, "invalid_request", str(exc), field) from None
    for field, value in (("model", model), ("queue", queue), ("tenant", tenant)):
        problem = None if value is None else text_problem(value)
        if problem is not None:
            raise ApiError(422, "invalid_request", f"{field}: {problem}", field)
    if queue is not None and LANE_SEPARATOR in queue:
        raise ApiError(422, "invalid_request", f"queue: a queue's name holds no {LANE_SEPARATOR!r}", "queue")
    if model is not None and model not in settings.model_ids():
        raise ApiError(404, "model_not_found", str(settings.unknown_model(model)), "model")
    return TraceWindow(start, end, model=model, queue=queue, tenant=tenant)


def _chunks(header: bytes, spool: IO[bytes]) -> Iterator[bytes]:
    try:
        yield header
        spool.seek(0)
        while chunk := spool.read(READ_BYTES):
            yield chunk
    finally:
        spool.close()
