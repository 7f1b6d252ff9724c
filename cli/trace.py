"""`conveyor trace export`: the service's own traffic as a trace file (core/traces.py), read through the
admin route `GET /v1/admin/trace` with an admin API key (or the admin token; none with auth off).

The trace goes to --out (written beside it and renamed once complete, so a broken transfer leaves no
half trace under that name) or to stdout; a one-line summary goes to stderr.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import IO, Annotated, Any, NoReturn

import typer

from conveyor.cli.http_options import DEFAULT_URL, AdminKeyOpt, UrlOpt

trace_app = typer.Typer(no_args_is_help=True,
                        help="Traces of the service's own traffic: export (shapes; text only if asked).")

TRACE_PATH = "/v1/admin/trace"  # api/routes/traces.py (the CLI does not import the API)
READ_BYTES = 1 << 16


@trace_app.command("export")
def trace_export(
    since: Annotated[str, typer.Option(help="the window's start: a duration ago (90s, 30m, 1h, 2d) or an ISO "
                                       "8601 time")],
    until: Annotated[str | None, typer.Option(help="the window's end, in either form (default: now)")] = None,
    model: Annotated[str | None, typer.Option(help="this served model's jobs only")] = None,
    queue: Annotated[str | None, typer.Option(help="this queue's jobs only (of every model)")] = None,
    tenant: Annotated[str | None, typer.Option(help="this tenant's jobs only (named by its hash)")] = None,
    with_text: Annotated[bool, typer.Option(help="add prompts and outputs (the header says so)")] = False,
    out: Annotated[Path | None, typer.Option(help="the trace file (default: stdout)")] = None,
    url: UrlOpt = DEFAULT_URL,
    api_key: AdminKeyOpt = None,
    timeout: Annotated[float, typer.Option(min=1, help="seconds to wait for the export to start")] = 600.0,
) -> None:
    """Exports the jobs created in the window, every status, as JSON lines: a header (inventory, filters,
    count), then per job its arrival, model, queue, token lengths, deadline, flags and hashed tenant."""
    import httpx

    params = {name: value for name, value in dict(since=since, until=until, model=model, queue=queue,
                                                   tenant=tenant).items() if value is not None}
    if with_text:
        params["with_text"] = "true"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client = httpx.Client(base_url=url, headers=headers, timeout=httpx.Timeout(30.0, read=timeout))
    try:
        with client, client.stream("GET", TRACE_PATH, params=params) as response:
            if response.status_code != 200:
                _fail(f"HTTP {response.status_code}: {_error_message(response.read())}")
            jobs = _save(response.iter_bytes(READ_BYTES), out)
    except httpx.HTTPError as exc:
        _fail(f"{url}: {exc}")
    typer.echo(f"exported {jobs} jobs to {out if out is not None else 'stdout'}", err=True)


def _save(chunks: Any, out: Path | None) -> int:
    """Writes the trace to `out` (via a `.part` file, renamed once complete) or stdout; returns the job
    count its header gives."""
    if out is None:
        return _copy(chunks, sys.stdout.buffer)
    partial = out.with_name(out.name + ".part")
    try:
        with partial.open("wb") as file:
            jobs = _copy(chunks, file)
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return jobs


def _copy(chunks: Any, sink: IO[bytes]) -> int:
    first = b""
    for chunk in chunks:
        if b"\n" not in first:
            first += chunk
        sink.write(chunk)
    sink.flush()
    try:
        header = json.loads(first.partition(b"\n")[0])
    except ValueError:
        header = None
    if not isinstance(header, dict) or "conveyor_trace" not in header:
        _fail("the answer is not a trace: its first line has no `conveyor_trace`")
    return int(header["jobs"])


def _error_message(body: bytes) -> str:
    try:
        error = json.loads(body).get("error", {})
    except (ValueError, AttributeError):
        return body.decode(errors="replace")[:200]
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)


def _fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)
