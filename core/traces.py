"""A trace of the operator's own traffic: the jobs of a time window as JSON lines of their shapes (arrival,
model, queue, token lengths, deadline, flags), for replaying and tuning (docs/operations: the seed's method on
one's own traffic). No prompt or output text unless the export asks for it.

The format (one JSON object per line; bench/ reads it without importing this):
- line 1, the header (`conveyor_trace`: its version): when and what was exported (window, filters, whether
  text is in it, the number of job lines), how tenants are hashed, and the inventory it came from: per
  served model its source, the engine settings set and its queues' limits; a few service settings; the
  Conveyor version;
- then one line per job, in arrival order: `arrival_s` counts from the first exported job's created_at. A job
  arrives when it was created, or at its run_at when it was submitted to run later (scheduled; not when its
  run_at is a retry's).

Tenants are named only by a keyed hash (HMAC-SHA256, 16 hex digits): with `trace_hash_key` set, the same
tenant hashes alike in every export; without it each export draws a key, so hashes compare only within it.
A generation job's prompt is kept, without its text, as `prefix_blocks`: a chain of hashes under the same key,
one per full block of `prefix_block_tokens` (the header's) token ids (core/trace_prefixes.py), so a replay can
share prefixes as production did.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import importlib.metadata
import itertools
import json
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import IO, Any

from conveyor.core.lanes import split_lane
from conveyor.core.protocol.chat_options import ChatOptions
from conveyor.core.protocol.job_kinds import EMBEDDING, GENERATION
from conveyor.core.protocol.job_params import JobParams
from conveyor.core.settings import Settings
from conveyor.core.settings.engine import PER_MODEL_FIELDS, EngineSettings
from conveyor.core.store.trace_rows import TraceRow, TraceWindow
from conveyor.core.trace_prefixes import HASH_HEX_DIGITS, PREFIX_BLOCK_TOKENS, PromptIds, block_hashes
from conveyor.core.views.tool_calls import read_output

TRACE_VERSION = 1
PACKAGE = "conveyor"
HASH_METHOD = "hmac-sha256"
QUEUE_FIELDS = ("max_running", "priority", "max_queued", "default_deadline_s")  # what a replay needs to know


@dataclass(frozen=True)
class TraceExport:
    """What one export reads and how it names tenants and hashes prompts."""

    window: TraceWindow
    with_text: bool
    hash_key: bytes
    key_configured: bool  # trace_hash_key set: hashes compare across exports
    prompt_ids: PromptIds | None = None  # each job's prompt ids, for its prefix_blocks; None: all null

    @classmethod
    def of(cls, settings: Settings, window: TraceWindow, with_text: bool,
           prompt_ids: PromptIds | None = None) -> TraceExport:
        configured = settings.trace_hash_key
        if configured is not None:
            key, key_configured = configured.get_secret_value().encode(), True
        else:
            key, key_configured = secrets.token_bytes(32), False
        return cls(window, with_text, key, key_configured, prompt_ids)

    @property
    def reads_prompts(self) -> bool:
        """Whether its rows need the prompt columns (core/store/trace_rows.py TEXT_COLUMNS): to write them,
        or to hash them (then read, never written)."""
        return self.with_text or self.prompt_ids is not None

    def tenant_hash(self, tenant: str) -> str:
        return hmac.new(self.hash_key, tenant.encode(), hashlib.sha256).hexdigest()[:HASH_HEX_DIGITS]

    def prefix_blocks(self, row: TraceRow) -> list[str] | None:
        """Its prompt's block hashes (core/trace_prefixes.py); None when no prompt ids are known for it."""
        ids = None if self.prompt_ids is None else self.prompt_ids(row)
        return None if ids is None else block_hashes(ids, self.hash_key)


def write_lines(rows: Iterable[TraceRow], export: TraceExport, out: IO[bytes]) -> int:
    """Writes the job lines of `rows` (oldest created first) to `out`, in arrival order; returns how many."""
    remaining = iter(rows)
    first = next(remaining, None)
    if first is None:
        return 0
    origin = first.created_at  # nothing exported arrives before it
    count = 0
    for arrival, row in in_arrival_order(itertools.chain([first], remaining)):
        out.write(_json_line(trace_line(row, arrival, origin, export)))
        count += 1
    return count


def in_arrival_order(rows: Iterable[TraceRow]) -> Iterator[tuple[datetime, TraceRow]]:
    """(arrival, row) by arrival, of rows that come by created_at. A job arrives no earlier than it was
    created, so a held row arriving by the current row's created_at can go: no later row arrives before
    it. Only jobs scheduled past the rows read so far are held."""
    held: list[tuple[datetime, datetime, str, TraceRow]] = []
    for row in rows:
        while held and held[0][0] <= row.created_at:
            arrival, _, _, ready = heapq.heappop(held)
            yield arrival, ready
        heapq.heappush(held, (arrival_of(row), row.created_at, row.id, row))
    while held:
        arrival, _, _, ready = heapq.heappop(held)
        yield arrival, ready


def arrival_of(row: TraceRow) -> datetime:
    """When the job arrived: created, or due at its asked run_at. A run_at of a retried job (`retries`, or
    an earlier run kept in `history`) is when the retry was due, not an arrival."""
    asked = row.run_at is not None and not row.retries and not row.history
    return row.run_at if asked and row.run_at > row.created_at else row.created_at


def trace_line(row: TraceRow, arrival: datetime, origin: datetime, export: TraceExport) -> dict[str, Any]:
    """One job's line (the module doc)."""
    params = JobParams.from_stored(row.params)
    chat = ChatOptions.from_json(row.chat)
    kind = row.kind or GENERATION
    model, queue = split_lane(row.queue)
    due = row.run_at or row.created_at  # what deadline_at counts from (core/store/jobs/retries.py)
    line: dict[str, Any] = {
        "request_id": row.id, "arrival_s": _seconds(origin, arrival), "model": model, "group": queue,
        "kind": kind, "status": row.status, "prompt_tokens": row.prompt_tokens,
        "max_tokens": 0 if kind == EMBEDDING else params.max_tokens, "output_tokens": row.completion_tokens,
        "n": params.n, "deadline_s": _seconds(due, row.deadline_at), "priority": row.priority,
        "tier": row.service_tier, "structured": params.structured is not None and not chat.constrained,
        "tools": bool(chat.tools), "tool_call": _called_tools(row, chat), "adapter": params.lora,
        "tenant": export.tenant_hash(row.tenant_id), "batch": row.batch_id is not None,
        "queue_s": _seconds(arrival, row.started_at), "ttft_s": _seconds(arrival, row.first_token_at),
        "e2e_s": _seconds(arrival, row.finished_at), "preemptions": row.preemptions or 0,
        "prefix_blocks": export.prefix_blocks(row),
    }
    if export.with_text:
        line.update(_texts(row, kind))
    return line


def _called_tools(row: TraceRow, chat: ChatOptions) -> bool:
    """Whether its answer (choice 0) holds a tool call, read as its GET reads it (core/views/tool_calls)."""
    if not chat.reads_tool_calls or row.result_text is None:
        return False
    return bool(read_output(row.result_text, chat, row.id).tool_calls)


def _texts(row: TraceRow, kind: str) -> dict[str, Any]:
    """The request as sent (its prompt, messages or inputs) and choice 0's text (null: none yet, or an
    embedding)."""
    if row.messages is not None:
        asked: dict[str, Any] = {"messages": row.messages}
    elif row.prompt is not None:
        asked = {"prompt": row.prompt}
    else:
        asked = {"inputs": row.inputs}
    return {**asked, "output": None if kind == EMBEDDING else row.result_text}


def trace_header(settings: Settings, export: TraceExport, jobs: int, exported_at: datetime) -> dict[str, Any]:
    window = export.window
    tenant = None if window.tenant is None else export.tenant_hash(window.tenant)
    key = "configured" if export.key_configured else "per-export"
    return {
        "conveyor_trace": TRACE_VERSION, "version": conveyor_version(),
        "exported_at": exported_at.isoformat(),
        "since": window.since.isoformat(), "until": window.until.isoformat(),
        "filters": {"model": window.model, "queue": window.queue, "tenant": tenant},
        "with_text": export.with_text, "jobs": jobs,
        "tenant_hash": {"method": HASH_METHOD, "key": key}, "prefix_block_tokens": PREFIX_BLOCK_TOKENS,
        "inventory": inventory(settings),
    }


def header_line(header: dict[str, Any]) -> bytes:
    return _json_line(header)


def inventory(settings: Settings) -> dict[str, Any]:
    """The served models (source, engine settings set, queue limits) and a few service settings; no
    secrets, no URLs (they may hold passwords)."""
    models = {model_id: {"source": served.model_source(), "engine": engine_settings_set(served),
                         "queues": {name: {field: getattr(limits, field) for field in QUEUE_FIELDS}
                                    for name, limits in served.queues.items()}}
              for model_id, served in settings.served().items()}
    service = {
        "auth_enabled": settings.auth_enabled, "api_workers": settings.api_workers,
        "embedded": settings.embedded, "database": settings.database_url.partition(":")[0].partition("+")[0],
        "default_model": settings.default_model_id(), "max_attempts": settings.max_attempts,
        "tenant_weight": settings.tenant_weight, "tenant_max_queued": settings.tenant_max_queued,
        "tenant_max_running": settings.tenant_max_running,
        "tenant_tokens_per_minute": settings.tenant_tokens_per_minute,
    }
    return {"models": models, "settings": service}


def engine_settings_set(settings: Settings) -> dict[str, Any]:
    """The engine settings that differ from their defaults (unset: the engine's own)."""
    defaults = EngineSettings()
    return {name: getattr(settings, name) for name in PER_MODEL_FIELDS
            if getattr(settings, name) != getattr(defaults, name)}


def conveyor_version() -> str:
    """The installed package's version, as GET /version reports it."""
    return importlib.metadata.version(PACKAGE)


def _seconds(start: datetime, end: datetime | None) -> float | None:
    return None if end is None else round((end - start).total_seconds(), 6)


def _json_line(value: dict[str, Any]) -> bytes:
    return (json.dumps(value, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
