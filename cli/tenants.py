"""`conveyor tenants set|show|list`: each tenant's limits, straight in the store (like `conveyor keys`).

A tenant's value of a limit overrides the setting of the same name (`tenant_weight`, `tenant_max_queued`,
`tenant_max_running`, `tenant_tokens_per_minute`, `retention_days`, `tenant_min_priority`,
`tenant_max_priority`); `--reset NAME` gives the setting back.
`--cache-namespace NAME` puts the tenant's jobs in a prefix-cache partition shared with the other tenants
given NAME (by default a tenant's is its own); `--reset cache_namespace` makes it its own again.
The workers read the store at every claim; the API processes cache a tenant's limits for at most
`auth_cache_s`, and on PostgreSQL drop them as the change commits (core/store/auth_notices.py): a change
applies at once there, within auth_cache_s on SQLite.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from conveyor.cli.errors import remember_settings
from conveyor.core.settings import Settings, load_settings

tenants_app = typer.Typer(no_args_is_help=True,
                          help="Per-tenant limits: fair-share weight, quotas, retention, cache namespace.")

ConfigOpt = Annotated[Path | None, typer.Option("--config", help="TOML settings (or CONVEYOR_CONFIG_FILE)")]
TenantArg = Annotated[str, typer.Argument(help="tenant id (created if new)")]


@tenants_app.command("set")
def tenants_set(
    ctx: typer.Context,
    tenant: TenantArg,
    weight: Annotated[float | None, typer.Option(help="share of a queue's slots against others")] = None,
    max_queued: Annotated[int | None, typer.Option(help="queued jobs per queue (429 beyond)")] = None,
    max_running: Annotated[int | None, typer.Option(help="running jobs per queue, across workers")] = None,
    tokens_per_minute: Annotated[int | None, typer.Option(help="prompt + output tokens a minute")] = None,
    retention_days: Annotated[int | None, typer.Option(help="finished data is purged after this")] = None,
    cache_namespace: Annotated[str | None, typer.Option(
        help="share cached prompt prefixes with the tenants given the same name (default: its own)")] = None,
    min_priority: Annotated[int | None, typer.Option(
        help="the most urgent priority its jobs may ask for (lower first; the priority tier is -1)")] = None,
    max_priority: Annotated[int | None, typer.Option(
        help="the least urgent priority its jobs may ask for")] = None,
    reset: Annotated[list[str] | None, typer.Option(
        help="a limit to give back to the setting's default (repeatable), e.g. --reset max_running")] = None,
    config: ConfigOpt = None,
) -> None:
    """Sets a tenant's own limits (creating the tenant if new) and prints them as JSON."""
    from conveyor.core.clock import utcnow
    from conveyor.core.store import tenants

    given = dict(weight=weight, max_queued=max_queued, max_running=max_running,
                 tokens_per_minute=tokens_per_minute, retention_days=retention_days,
                 cache_namespace=cache_namespace, min_priority=min_priority, max_priority=max_priority)
    changes: dict[str, Any] = {name: value for name, value in given.items() if value is not None}
    for name in reset or []:
        field = name.replace("-", "_")
        if field in changes:
            _fail(f"{field}: both set and reset")
        changes[field] = None
    if not changes:
        _fail("nothing to set: give at least one of --weight, --max-queued, --max-running, "
              "--tokens-per-minute, --retention-days, --cache-namespace, --min-priority, --max-priority "
              "or --reset")
    settings = _settings(ctx, config)
    with _session(settings) as session:
        try:
            row = tenants.set_overrides(session, tenant, changes, utcnow())
        except ValueError as exc:
            _fail(str(exc))
        typer.echo(json.dumps(_describe(row, settings), indent=2))


@tenants_app.command("show")
def tenants_show(
    ctx: typer.Context, tenant: Annotated[str, typer.Argument(help="tenant id")], config: ConfigOpt = None
) -> None:
    """Prints a tenant's own limits (null: the default) and the limits in effect, as JSON."""
    from conveyor.core.store.tables import Tenant

    settings = _settings(ctx, config)
    with _session(settings) as session:
        row = session.get(Tenant, tenant)
        if row is None:
            _fail(f"tenant {tenant}: no such tenant")
        typer.echo(json.dumps(_describe(row, settings), indent=2))


@tenants_app.command("list")
def tenants_list(ctx: typer.Context, config: ConfigOpt = None) -> None:
    """Lists tenants and the limits in effect for each (* marks the tenant's own value)."""
    from rich.console import Console
    from rich.table import Table

    from conveyor.core.store import tenants

    settings = _settings(ctx, config)
    table = Table("tenant", *tenants.LIMIT_FIELDS, "cache_namespace")
    with _session(settings) as session:
        for row in tenants.list_tenants(session):
            own = tenants.overrides_of(row)
            effective = _effective(row, settings)
            table.add_row(row.id, *(_cell(effective[name], own[name] is not None)
                                    for name in tenants.LIMIT_FIELDS), _cell(row.cache_namespace, False))
    Console(width=120).print(table)


def _describe(row: Any, settings: Settings) -> dict[str, Any]:
    from conveyor.core.store import tenants

    return {"tenant": row.id, "overrides": tenants.overrides_of(row), "effective": _effective(row, settings)}


def _effective(row: Any, settings: Settings) -> dict[str, Any]:
    from conveyor.core.store.tenants import TenantLimits, cache_salt

    limits = asdict(TenantLimits.defaults(settings).with_overrides(row))
    return {**limits, "cache_salt": cache_salt(row.id, row.cache_namespace)}


def _cell(value: Any, own: bool) -> str:
    text = "-" if value is None else str(value)
    return f"{text}*" if own else text


def _settings(ctx: typer.Context, config: Path | None) -> Settings:
    try:
        settings = load_settings(config)
    except ValueError as exc:
        _fail(str(exc))
    remember_settings(ctx, settings)  # the URLs a connection error is about (cli/errors.py)
    return settings


def _session(settings: Settings) -> Any:
    from conveyor.core.store.database import make_db_engine, make_session_factory

    return make_session_factory(make_db_engine(settings.database_url))()


def _fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)
