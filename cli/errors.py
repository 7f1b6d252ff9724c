"""What a `conveyor` command prints when it cannot reach its database or broker: one line, not a traceback.

A newcomer's first failures are set-up problems (no role, no database, nothing listening on the port), and
a 500-line traceback hides the one line that matters. Every command runs inside ConveyorGroup.invoke, which
turns those errors into `error: <what it tried>: <what went wrong>; fix: <the likely fix>` on stderr and
exit code 2. `conveyor --debug ...` lets the exception through with its full traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import typer
from typer.core import TyperGroup

from conveyor.core.log_setup import masked_url

EXIT_SETUP = 2  # like a usage error: the command never got to do its work
CAUSE_DEPTH = 5  # how far down __cause__/__context__ a known error is looked for (wrapped by a library)

# (module, class) of the errors that mean "could not reach or use the database" and "... the broker". Only
# classes of modules already imported are checked: an exception of a module never imported cannot have
# been raised, and importing SQLAlchemy or kombu here would slow every command that fails.
DATABASE_ERRORS = (("sqlalchemy.exc", "OperationalError"), ("sqlalchemy.exc", "InterfaceError"),
                   ("psycopg", "OperationalError"), ("sqlite3", "OperationalError"))
MISSING_TABLE_ERRORS = (("psycopg.errors", "UndefinedTable"),)
BROKER_ERRORS = (("redis.exceptions", "ConnectionError"), ("redis.exceptions", "TimeoutError"),
                 ("kombu.exceptions", "OperationalError"))
MODEL_ERRORS = (("conveyor.checkpoints.sources", "ModelSourceError"),)  # engine/loader's ModelFolderError too
MODEL_FIX = ("set CONVEYOR_MODEL to a Hugging Face model folder (config.json, *.safetensors, tokenizer "
             "files), a GGUF file, a cached hub id or preset:NAME, or unset it to serve "
             "SmolLM2-135M-Instruct")


class SetupError(Exception):
    """A problem the user fixes by configuration, already phrased as one line (what, why, fix)."""

    def __init__(self, what: str, reason: str, fix: str) -> None:
        super().__init__(f"{what}: {reason}; fix: {fix}")


INVOCATION_KEY = "conveyor.invocation"


@dataclass
class Invocation:
    """The running command's --debug flag and Settings, kept in its typer Context's `meta` (one dict that
    every context of one invocation shares): two invocations in one process (CliRunner) never meet."""

    debug: bool = False
    settings: Any = None  # the URLs that a connection error is about


class ConveyorGroup(TyperGroup):
    """The `conveyor` command group: runs the chosen command, translating set-up errors (module docstring)."""

    def invoke(self, ctx: Any) -> Any:  # ctx: typer's click Context, its root options parsed
        invocation = Invocation(debug=bool(ctx.params.get("debug")))
        ctx.meta[INVOCATION_KEY] = invocation
        try:
            return super().invoke(ctx)
        except Exception as exc:
            line = None if invocation.debug else one_line(exc, invocation.settings)
            if line is None:
                raise
            typer.echo(f"error: {line} (conveyor --debug: the full traceback)", err=True)
            raise typer.Exit(EXIT_SETUP) from None


def invocation(ctx: Any) -> Invocation:
    """The Invocation of the command whose typer Context (or any of its parents') is `ctx`."""
    found: Invocation = ctx.meta.setdefault(INVOCATION_KEY, Invocation())
    return found


def debug_enabled(ctx: Any) -> bool:
    """Whether the running command was given `conveyor --debug`."""
    return invocation(ctx).debug


def remember_settings(ctx: Any, settings: Any) -> None:
    """Keeps the command's Settings for ConveyorGroup: the URLs that errors are about."""
    invocation(ctx).settings = settings


def one_line(exc: BaseException, settings: Any = None) -> str | None:
    """The one line for a set-up error; None for any other exception (a bug: its traceback is wanted)."""
    database_url = getattr(settings, "database_url", "") or ""
    for error in _chain(exc):
        if isinstance(error, SetupError):
            return str(error)
        if _is_any(error, MODEL_ERRORS):
            return f"{error}; fix: {MODEL_FIX}"
        reason = _reason(error)
        is_database = _is_any(error, DATABASE_ERRORS)
        if _is_any(error, MISSING_TABLE_ERRORS) or (is_database and "no such table" in reason):
            what = f"the database {masked_url(database_url)}" if database_url else "the database"
            return f"{what} has no Conveyor schema ({reason}); fix: run `conveyor migrate`"
        if is_database:
            return database_line(database_url, reason)
        if _is_any(error, BROKER_ERRORS):
            return broker_line(getattr(settings, "broker_url", "") or "", reason)
        if isinstance(error, ConnectionRefusedError):
            return (f"connection refused ({reason}); fix: start the servers that CONVEYOR_DATABASE_URL and "
                    "CONVEYOR_BROKER_URL name, or correct those settings")
    return None


def database_line(url: str, reason: str) -> str:
    what = f"cannot use the database {masked_url(url)}" if url else "cannot use the database"
    return f"{what}: {reason}; fix: {database_fix(url, reason)}"


def broker_line(url: str, reason: str) -> str:
    what = f"cannot reach the broker {masked_url(url)}" if url else "cannot reach the broker"
    return f"{what}: {reason}; fix: {broker_fix(url, reason)}"


def database_fix(url: str, reason: str) -> str:
    """The likely fix, from the driver's message (the steps of docs/getting-started/postgres-redis.md when a
    role or database is missing)."""
    parts = urlsplit(url)
    user, db = parts.username or "conveyor", parts.path.lstrip("/") or "conveyor"
    host = f"-h {parts.hostname} " if parts.hostname else ""
    elsewhere = "or set CONVEYOR_DATABASE_URL"
    if parts.scheme.startswith("sqlite"):  # sqlite:///relative.db, sqlite:////absolute.db
        folder = os.path.dirname(parts.path[1:]) or "."
        return f"make sure the folder {folder} exists and is writable, or set CONVEYOR_DATA_DIR"
    if "role" in reason and "does not exist" in reason:
        return (f"create the role and database (as a PostgreSQL superuser): createuser {host}-U postgres "
                f"{user} && createdb {host}-U postgres -O {user} {db}; {elsewhere}")
    if "database" in reason and "does not exist" in reason:
        return f"create the database: createdb {host}-U postgres -O {user} {db}; {elsewhere}"
    if "password" in reason or "authentication" in reason:
        return f"check the user and password in CONVEYOR_DATABASE_URL (user {user!r})"
    where = f"{parts.hostname}:{parts.port or 5432}" if parts.hostname else "its host and port"
    return f"start PostgreSQL on {where} (e.g. `docker compose up -d postgres`), {elsewhere}"


def broker_fix(url: str, reason: str) -> str:
    parts = urlsplit(url)
    if "auth" in reason.lower() or "password" in reason.lower():
        return "check the password in CONVEYOR_BROKER_URL (redis://:PASSWORD@host:port/db)"
    where = f"{parts.hostname}:{parts.port or 6379}" if parts.hostname else "its host and port"
    return f"start Redis on {where} (e.g. `docker compose up -d redis`), or set CONVEYOR_BROKER_URL"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception, then what caused it: libraries wrap driver errors (kombu wraps redis's)."""
    seen: BaseException | None = exc
    for _ in range(CAUSE_DEPTH):
        if seen is None:
            return
        yield seen
        seen = seen.__cause__ or seen.__context__


def _is_any(exc: BaseException | None, names: tuple[tuple[str, str], ...]) -> bool:
    classes = tuple(cls for module, name in names
                    if (cls := getattr(sys.modules.get(module), name, None)) is not None)
    return exc is not None and bool(classes) and isinstance(exc, classes)


def _driver_error(exc: BaseException) -> BaseException | None:
    """SQLAlchemy's DBAPIError keeps the driver's exception in `.orig`."""
    orig = getattr(exc, "orig", None)
    return orig if isinstance(orig, BaseException) else None


def _reason(exc: BaseException) -> str:
    """The driver's first line, without its boilerplate: psycopg says `connection failed: connection to
    server at "h", port p failed: FATAL:  role "x" does not exist`, of which the end is the news."""
    text = str(_driver_error(exc) or exc).strip()
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)
    line = line.rsplit(" failed: ", 1)[-1]
    return line.removeprefix("FATAL:").strip().rstrip(".")
