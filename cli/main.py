"""The `conveyor` command: servers, migrations, API keys, a small client and the bench.

The one composition root: the only code that imports both api/ and worker/. Each command imports what it
runs inside its body, so `conveyor api` never loads the worker, the engine or torch.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from pydantic import ValidationError

from conveyor.checkpoints.sources import PRESET_PREFIX
from conveyor.cli.errors import ConveyorGroup, debug_enabled, remember_settings
from conveyor.cli.http_options import DEFAULT_URL, KeyOpt, UrlOpt
from conveyor.cli.preflight import check_port
from conveyor.cli.tenants import tenants_app
from conveyor.cli.trace import trace_app
from conveyor.core.log_setup import configure_logging, masked_url
from conveyor.core.settings import Settings, load_settings

# ConveyorGroup: a command that cannot reach its database or broker says so in one line (cli/errors.py).
app = typer.Typer(cls=ConveyorGroup, no_args_is_help=True,
                  help="Conveyor: a job queue for asynchronous LLM inference.")
keys_app = typer.Typer(no_args_is_help=True, help="Create, revoke and list API keys.")
app.add_typer(keys_app, name="keys")
app.add_typer(tenants_app, name="tenants")
app.add_typer(trace_app, name="trace")

ConfigOpt = Annotated[Path | None, typer.Option("--config", help="TOML settings (or CONVEYOR_CONFIG_FILE)")]
HostOpt = Annotated[str | None, typer.Option(help="bind address (default 127.0.0.1)")]
PortOpt = Annotated[int | None, typer.Option(help="port (default 8000)")]
ModelOpt = Annotated[str | None, typer.Option(
    "--model", help="the served model this worker runs (CONVEYOR_WORKER_MODEL; needed with several)")]
WorkersOpt = Annotated[int | None, typer.Option(
    help="processes serving HTTP on the port (default: the api_workers setting, 1)")]
RunAtOpt = Annotated[str | None, typer.Option(help="RFC 3339 time (with offset): not started before it")]
DelayOpt = Annotated[float | None, typer.Option("--delay", help="seconds from now: not started before")]
DEBUG_HELP = "show full tracebacks, and the start-up logs of alembic and Celery"
log = logging.getLogger("conveyor")


@app.callback()
def main(debug: Annotated[bool, typer.Option("--debug", help=DEBUG_HELP)] = False) -> None:
    """Conveyor: a job queue for asynchronous LLM inference."""  # --debug is read by debug_enabled(ctx)


@app.command()
def serve(ctx: typer.Context, host: HostOpt = None, port: PortOpt = None, config: ConfigOpt = None) -> None:
    """Everything in one process: API, worker and engine on SQLite with an in-process queue."""
    settings = _server_settings(ctx, config, host, port)
    if not settings.embedded:
        _fail("serve runs embedded: unset broker_url, or run `conveyor api` and `conveyor worker`")
    if settings.api_workers > 1:
        _fail(f"api_workers: serve runs one process (one SQLite writer, an in-process queue), not "
              f"{settings.api_workers}; for several, run `conveyor api --workers N` and `conveyor worker` on "
              "PostgreSQL and Redis")
    check_port(settings.host, settings.port)
    from conveyor.api.app import create_app
    from conveyor.cli.api_server import load_tokenizers
    from conveyor.core.store.migrate import upgrade
    from conveyor.worker.cold_start import ColdStart
    from conveyor.worker.embedded import EmbeddedRuntime

    cold_start = ColdStart()  # the imports are done: migrating and the models count in the rest
    for model_settings in settings.served().values():  # before the server starts: its lifespan would print
        _resolved(model_settings)  # a traceback; a GGUF file converted, a hub id downloaded, a preset built
    log.info(upgrade(settings.database_url, default_model=settings.default_model_id()).describe())
    label = _model_label(settings)
    runtime = EmbeddedRuntime(settings, cold_start=cold_start)
    # One db engine for the API and the runtime: one SQLite writer queue for both.
    application = create_app(settings, publisher=runtime.publisher,
                             tokenizer=load_tokenizers(settings), runtime=runtime,
                             token_stream=runtime.token_stream, finished_watch=runtime.finished,
                             finished_sink=runtime.finished, session_factory=runtime.sessions)
    _run_api(settings, label, application)


@app.command()
def api(ctx: typer.Context, host: HostOpt = None, port: PortOpt = None, config: ConfigOpt = None,
        workers: WorkersOpt = None) -> None:
    """The HTTP API alone, publishing to the Celery broker (run `conveyor migrate` first)."""
    settings = _server_settings(ctx, config, host, port, api_workers=workers)
    if settings.embedded:
        _fail("api needs broker_url (CONVEYOR_BROKER_URL=redis://...); `conveyor serve` runs embedded")
    if settings.api_workers > 1 and settings.database_url.startswith("sqlite"):
        _fail(f"api_workers: {settings.api_workers} processes need PostgreSQL (CONVEYOR_DATABASE_URL="
              "postgresql+psycopg://...): SQLite takes one writer at a time, and each process would queue "
              "its writes apart")
    from conveyor.cli.api_server import FACTORY, build_api_app, pass_down
    from conveyor.cli.preflight import check_broker, check_database

    check_port(settings.host, settings.port)
    _check_tokenizer_files(settings)
    check_database(settings.database_url)
    check_broker(settings.broker_url or "")
    if settings.api_workers > 1:
        pass_down(config, host, port, workers)
        _run_api(settings, _model_label(settings), FACTORY)
        return
    application, closing = build_api_app(settings)
    try:
        _run_api(settings, _model_label(settings), application)
    finally:
        for resource in closing:
            resource.close()


@app.command()
def worker(ctx: typer.Context, config: ConfigOpt = None, model: ModelOpt = None) -> None:
    """One GPU worker: loads one model's engine and consumes that model's queues."""
    settings = _settings(ctx, config, worker_model=model)
    _configure_logging(ctx, settings)
    if settings.embedded:
        _fail("worker needs broker_url (CONVEYOR_BROKER_URL=redis://...); `conveyor serve` runs embedded")
    try:
        served = settings.for_model(settings.worker_model_id())
    except ValueError as exc:
        _fail(str(exc))
    from conveyor.cli.preflight import check_broker, check_database
    from conveyor.worker.celery_worker import run_worker
    from conveyor.worker.cold_start import ColdStart

    cold_start = ColdStart()  # the imports are done; the checks below count in the rest of the cold start
    _resolved(served)
    check_database(settings.database_url)  # both before the engine loads: a set-up error fails in seconds
    check_broker(settings.broker_url or "")
    run_worker(settings, banner=debug_enabled(ctx), cold_start=cold_start)


@app.command()
def migrate(ctx: typer.Context, config: ConfigOpt = None) -> None:
    """Upgrades the database to the latest schema (alembic upgrade head)."""
    from conveyor.core.store.migrate import upgrade

    settings = _settings(ctx, config)
    _configure_logging(ctx, settings)
    typer.echo(upgrade(settings.database_url, default_model=settings.default_model_id()).describe())


@keys_app.command("create")
def keys_create(ctx: typer.Context, tenant: Annotated[str, typer.Option(help="tenant the key belongs to")],
                admin: Annotated[bool, typer.Option(help="also sees totals across tenants")] = False,
                config: ConfigOpt = None) -> None:
    """Creates a key (and the tenant if new). The key is printed once; only its hash is stored."""
    from conveyor.core.clock import utcnow
    from conveyor.core.store import keys

    with _session(ctx, config) as session:
        try:
            row, plaintext = keys.create_key(session, tenant, utcnow(), admin=admin)
        except ValueError as exc:
            _fail(str(exc))
    typer.echo(json.dumps({"id": row.id, "tenant": row.tenant_id, "key": plaintext, "admin": row.is_admin}))


@keys_app.command("revoke")
def keys_revoke(ctx: typer.Context, key_id: str, config: ConfigOpt = None) -> None:
    """Revokes a key by id; requests with it get 401 from then on (every API process drops it from its cache
    at once on PostgreSQL, within auth_cache_s otherwise)."""
    from conveyor.core.clock import utcnow
    from conveyor.core.store import keys

    with _session(ctx, config) as session:
        if not keys.revoke_key(session, key_id, utcnow()):
            _fail(f"key {key_id}: no such active key")
    typer.echo(f"revoked {key_id}")


@keys_app.command("list")
def keys_list(ctx: typer.Context, config: ConfigOpt = None) -> None:
    """Lists keys: id, tenant, display prefix, created, revoked."""
    from rich.console import Console
    from rich.table import Table

    from conveyor.core.store import keys

    table = Table("id", "tenant", "prefix", "created", "revoked", "admin")
    with _session(ctx, config) as session:
        for k in keys.list_keys(session):
            revoked = k.revoked_at.isoformat(timespec="seconds") if k.revoked_at else ""
            created = k.created_at.isoformat(timespec="seconds")
            table.add_row(k.id, k.tenant_id, k.prefix + "…", created, revoked, "yes" if k.is_admin else "")
    Console(width=120).print(table)


@app.command()
def submit(
    prompt: Annotated[str | None, typer.Argument(help="prompt text (or use --messages-file)")] = None,
    messages_file: Annotated[Path | None, typer.Option(help="JSON file with a list of chat messages")] = None,
    queue: Annotated[str, typer.Option(help="interactive or documents")] = "interactive",
    max_tokens: Annotated[int | None, typer.Option()] = None,
    temperature: Annotated[float | None, typer.Option()] = None,
    seed: Annotated[int | None, typer.Option()] = None,
    ttl: Annotated[float | None, typer.Option(help="seconds to start before expiring")] = None,
    timeout: Annotated[float | None, typer.Option(help="seconds of running before failing")] = None,
    metadata: Annotated[str | None, typer.Option(help="JSON object returned with the job")] = None,
    idempotency_key: Annotated[str | None, typer.Option()] = None,
    run_at: RunAtOpt = None,
    delay: DelayOpt = None,
    max_retries: Annotated[int | None, typer.Option(help="automatic retries of retryable failures")] = None,
    url: UrlOpt = DEFAULT_URL,
    api_key: KeyOpt = None,
) -> None:
    """Submits a job and prints it as JSON (status `scheduled` with --run-at or --delay)."""
    if (prompt is None) == (messages_file is None):
        _fail("give exactly one of PROMPT or --messages-file")
    body: dict[str, Any] = {"queue": queue}
    if prompt is not None:
        body["prompt"] = prompt
    else:
        assert messages_file is not None
        body["messages"] = json.loads(messages_file.read_text())
    optional = dict(max_tokens=max_tokens, temperature=temperature, seed=seed, ttl=ttl, timeout=timeout,
                    metadata=json.loads(metadata) if metadata else None, max_retries=max_retries,
                    **_schedule(run_at, delay))
    body.update({k: v for k, v in optional.items() if v is not None})
    _print_call(url, api_key, lambda c: c.submit(body, idempotency_key))


@app.command()
def status(job_id: str, url: UrlOpt = DEFAULT_URL, api_key: KeyOpt = None) -> None:
    """Prints a job as JSON."""
    _print_call(url, api_key, lambda c: c.get(job_id))


@app.command()
def wait(
    job_id: str,
    timeout: Annotated[float | None, typer.Option(help="give up after this many seconds")] = None,
    url: UrlOpt = DEFAULT_URL,
    api_key: KeyOpt = None,
    _poll: Annotated[float | None, typer.Option("--poll", hidden=True, help="ignored: it long polls")] = None,
) -> None:
    """Waits for the job to finish (long polls, `GET /v1/jobs/ID?wait=30`) and prints it; exits 1 unless it
    succeeded, 2 on --timeout."""
    job = _print_call(url, api_key, lambda c: c.wait(job_id, timeout))
    if job["status"] != "succeeded":
        raise typer.Exit(1)


@app.command()
def cancel(job_id: str, url: UrlOpt = DEFAULT_URL, api_key: KeyOpt = None) -> None:
    """Cancels a queued or running job and prints it."""
    _print_call(url, api_key, lambda c: c.cancel(job_id))


@app.command()
def retry(
    job_id: str,
    run_at: RunAtOpt = None,
    delay: DelayOpt = None,
    idempotency_key: Annotated[str | None, typer.Option()] = None,
    url: UrlOpt = DEFAULT_URL,
    api_key: KeyOpt = None,
) -> None:
    """Runs a failed, cancelled or expired job again under its id (POST /v1/jobs/ID/retry) and prints it."""
    _print_call(url, api_key, lambda c: c.retry(job_id, _schedule(run_at, delay), idempotency_key))


def _schedule(run_at: str | None, delay: float | None) -> dict[str, Any]:
    """The body fields of --run-at / --delay (the API judges them: a bad time is its 422)."""
    if run_at is not None and delay is not None:
        _fail("give --run-at or --delay, not both")
    if run_at is not None:
        return {"run_at": run_at}
    return {"delay_s": delay} if delay is not None else {}


@app.command()
def purge(
    queue: str,
    model: Annotated[str | None, typer.Option(help="this served model's queue only")] = None,
    url: UrlOpt = DEFAULT_URL,
    api_key: KeyOpt = None,
) -> None:
    """Cancels every queued and scheduled job of yours in QUEUE (every tenant's with an admin key) and prints
    the count."""
    _print_call(url, api_key, lambda c: c.purge(queue, model))


@app.command()
def top(
    url: UrlOpt = DEFAULT_URL,
    worker: Annotated[list[str] | None, typer.Option(help="a worker's metrics URL (repeatable)")] = None,
    metrics_token: Annotated[str | None, typer.Option(envvar="CONVEYOR_METRICS_TOKEN")] = None,
    interval: Annotated[float, typer.Option(min=0.2, help="seconds between refreshes")] = 2.0,
    once: Annotated[bool, typer.Option(help="print one frame (rates over one interval) and exit")] = False,
) -> None:
    """Queues, workers and engines in a refreshing terminal view, read from the metrics (like htop)."""
    from conveyor.cli.top import run_top

    run_top(url, worker or [], metrics_token, interval, once)


PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


@app.command(context_settings=PASSTHROUGH, add_help_option=False)
def bench(ctx: typer.Context) -> None:
    """Benchmark the engine or a running service (`conveyor bench --help` lists its options)."""
    from conveyor.bench.cli import main

    raise typer.Exit(main(list(ctx.args)))


@app.command(context_settings=PASSTHROUGH, add_help_option=False)
def tune(ctx: typer.Context) -> None:
    """Pick engine and queue limits from a trace of your traffic, one change at a time (`conveyor tune
    --help` lists its options)."""
    from conveyor.cli.tune import main

    raise typer.Exit(main(list(ctx.args)))


@app.command("bench-store")
def bench_store(
    scale: Annotated[str, typer.Option(help="columns, comma-separated QUEUED:HISTORY (1k = 1000, 1M = "
                                       "1000000): queued jobs in one queue : finished jobs kept")] = (
        "1k:0,100k:0,100k:1M"),
    queued: Annotated[int | None, typer.Option(help="one column instead: this many queued (default 100000)")
                      ] = None,
    history: Annotated[int | None, typer.Option(help="one column instead: this many finished (default "
                                                "1000000)")] = None,
    tenants: Annotated[int, typer.Option(min=1, help="tenants the jobs are spread over")] = 10,
    repeat: Annotated[int, typer.Option(min=1, help="timed runs per operation, after one untimed")] = 20,
    queue: Annotated[str, typer.Option(help="the queue of the backlog")] = "interactive",
    database_url: Annotated[str | None, typer.Option(
        help="a throwaway PostgreSQL database to empty and fill (default: a new one on --server)")] = None,
    server: Annotated[str | None, typer.Option(
        envvar="CONVEYOR_BENCH_POSTGRES",
        help="PostgreSQL server URL to create the database on (default postgres@127.0.0.1)")] = None,
    keep: Annotated[bool, typer.Option(help="keep the database it created (prints its URL)")] = False,
    explain: Annotated[bool, typer.Option(help="also say which operations' plans scan jobs sequentially")
                       ] = False,
    out: Annotated[Path | None, typer.Option(help="also write the figures as JSON")] = None,
) -> None:
    """Times every per-job and per-round store operation on PostgreSQL with a backlog and a history of
    given sizes (filled with bulk SQL): median / p90 ms per scale."""
    from conveyor.cli.store_bench import options_args, run_store_bench

    try:
        args = options_args(scale, queued, history, tenants=tenants, repeat=repeat, queue=queue,
                            database_url=database_url, server=server, keep=keep, explain=explain, out=out)
        run_store_bench(args)
    except ValueError as exc:
        _fail(str(exc))


def _settings(ctx: typer.Context, config: Path | None, **overrides: Any) -> Settings:
    try:
        settings = load_settings(config, **overrides)
    except ValidationError as exc:
        _fail("settings: " + "; ".join(_setting_problem(error) for error in exc.errors()))
    except ValueError as exc:
        _fail(str(exc))
    remember_settings(ctx, settings)  # the URLs a connection error is about (cli/errors.py)
    return settings


def _setting_problem(error: Any) -> str:
    """One invalid setting in one phrase: where (the field, when pydantic knows it) and why."""
    where = ".".join(map(str, error["loc"]))
    why = str(error["msg"]).removeprefix("Value error, ")
    return f"{where}: {why}" if where else why


def _configure_logging(ctx: typer.Context, settings: Settings) -> None:
    configure_logging(settings, debug=debug_enabled(ctx))


def _server_settings(ctx: typer.Context, config: Path | None, host: str | None, port: int | None,
                     **overrides: Any) -> Settings:
    settings = _settings(ctx, config, host=host, port=port, **overrides)
    try:
        settings.check_bind()
    except ValueError as exc:
        _fail(str(exc))
    _configure_logging(ctx, settings)
    return settings


def _run_api(settings: Settings, model_label: str, application: Any) -> None:
    """Serves `application` (an app, or the import string of a factory for several worker processes)."""
    import uvicorn

    auth = "on" if settings.auth_enabled else "off (loopback only)"
    queue = "in-process" if settings.embedded else f"broker {masked_url(settings.broker_url or '')}"
    processes = f"; {settings.api_workers} processes" if settings.api_workers > 1 else ""
    log.info("starting on http://%s:%d, auth %s; model: %s; database: %s; queue: %s%s", settings.host,
             settings.port, auth, model_label, masked_url(settings.database_url), queue, processes)
    _exit_zero_on_sigterm()
    uvicorn.run(application, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                access_log=settings.access_log, factory=isinstance(application, str),
                workers=settings.api_workers if isinstance(application, str) else None)


def _exit_zero_on_sigterm() -> None:
    """uvicorn shuts down gracefully on SIGTERM, then raises the signal again for the handler that was there
    before it; the default one kills the process (status 143, "Terminated" in a shell). A shutdown that went
    as planned exits 0, as it does on Ctrl-C."""
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(0))


def _model_label(settings: Settings) -> str:
    """What a start-up line calls the models: each one's id and source."""
    if settings.models:
        return ", ".join(f"{model_id} ({spec.path})" for model_id, spec in settings.models.items())
    return f"{settings.served_model_id()} ({settings.model_source()})"


def _resolved(settings: Settings) -> None:
    """The model's folder made whole before anything slow or any port (worker/model.py resolve_model); a
    source that cannot be read is one line naming it (cli/errors.py)."""
    from conveyor.worker.model import resolve_model

    resolve_model(settings)


def _check_tokenizer_files(settings: Settings) -> None:
    """The API counts prompt tokens with each model's tokenizer; it never builds nor loads a model."""
    for model_settings in settings.served().values():
        _check_model_tokenizer(model_settings)


def _check_model_tokenizer(settings: Settings) -> None:
    folder = settings.model_folder()  # a hub id's metadata downloaded, a GGUF file's converted
    if (folder / "tokenizer_config.json").is_file() or (folder / "tokenizer.json").is_file():
        return
    setting = "CONVEYOR_MODEL" if not settings.models else f"models.{settings.served_model_id()}.path"
    if not folder.is_dir() and settings.model_source().startswith(PRESET_PREFIX):
        _fail(f"model {settings.model_source()}: not built yet at {folder}: start `conveyor worker` once (it "
              "builds the preset into the shared data_dir), then start the API again")
    _fail(f"model: no tokenizer files in {folder} ({setting} must be the model the workers load)")


def _session(ctx: typer.Context, config: Path | None) -> Any:
    from conveyor.core.store.database import make_db_engine, make_session_factory

    return make_session_factory(make_db_engine(_settings(ctx, config).database_url))()


def _print_call(url: str, api_key: str | None, call: Any) -> dict[str, Any]:
    from conveyor.cli.http_client import ClientError, ConveyorClient

    client = ConveyorClient.connect(url, api_key)
    try:
        result: dict[str, Any] = call(client)
    except (ClientError, TimeoutError) as exc:
        _fail(str(exc))
    except Exception as exc:  # connection refused and the like
        _fail(f"{url}: {exc}")
    finally:
        client.http.close()
    typer.echo(json.dumps(result, indent=2))
    return result


def _fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)
