"""The documentation's reference pages, rendered from the code: every setting (`Settings` and the per-queue
`QueueSettings`, with their descriptions and defaults; for the engine's fields, the engine's own default),
every HTTP route (from the app's OpenAPI document), every metric (from the worker's and the API's
registries) and every CLI command (its `--help`). The site's build
hook (docs/_hooks/reference_pages.py) adds them to the site each time it is built, so they cannot drift from
the code; tests/cli/test_reference_docs.py checks that none is missing.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import typer
from pydantic import SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from typer.testing import CliRunner

from api.app import create_app
from api.metrics import Metrics
from api.prompt_tokenizer import PromptTokenizer
from core.settings import QueueSettings, Settings, default_queues
from core.store.database import make_db_engine, make_session_factory
from core.store.migrate import upgrade
from engine.config import EngineConfig
from engine.host import EngineHost
from engine.stats import EngineTotals, StepStats, stats_dict
from worker.cold_start import ColdStart
from worker.engine_metrics import WorkerMetrics
from worker.model import engine_fields

ENV_PREFIX = "CONVEYOR_"
SETTINGS_PAGE = "reference/settings.md"
HTTP_PAGE = "reference/http-api.md"
METRICS_PAGE = "reference/metrics.md"
OPENAPI_FILE = "reference/openapi.json"
CLI_PAGE = "reference/cli.md"
HTTP_METHODS = ("get", "post", "put", "patch", "delete")
HELP_WIDTH = 100


def pages(app: typer.Typer) -> dict[str, str]:
    """Path under docs/ -> content: every reference page, and the OpenAPI document the HTTP page links."""
    document = openapi_document()
    return {SETTINGS_PAGE: settings_page(), HTTP_PAGE: http_page(document),
            OPENAPI_FILE: json.dumps(document, indent=2), METRICS_PAGE: metrics_page(exported_metrics()),
            CLI_PAGE: cli_page(app)}


# --- settings ----------------------------------------------------------------------------------------------


def settings_page() -> str:
    lines = [
        "# Settings",
        "",
        "Every setting of the one `Settings` object (`core/settings.py`), rendered from its field"
        " descriptions when this site was built. Each is read from the environment variable shown, from"
        " the TOML file (`--config` or `CONVEYOR_CONFIG_FILE`, the name without the prefix, in lower case),"
        " or defaults;"
        " [Configuration](../operations/configuration.md) explains precedence and gives an example.",
        "",
        "| variable | type | default | meaning |",
        "|---|---|---|---|",
    ]
    engine_names = set(engine_fields())
    for name, field in Settings.model_fields.items():
        if name == "queues":
            continue
        default = _engine_default(name) if name in engine_names else _default(field)
        lines.append(_row(ENV_PREFIX + name.upper(), field, default))
    lines += ["", "## Queues", "",
              "Each queue is a table of its own: `CONVEYOR_QUEUES__<QUEUE>__<FIELD>` in the environment,"
              " `[queues.<queue>]` in TOML. Defaults of the two built-in queues:"
              f" {_queue_defaults()}.", "",
              "| variable | type | default | meaning |", "|---|---|---|---|"]
    for name, field in QueueSettings.model_fields.items():
        lines.append(_row(f"{ENV_PREFIX}QUEUES__<QUEUE>__{name.upper()}", field, _default(field)))
    return "\n".join(lines) + "\n"


def _row(variable: str, field: FieldInfo, default: str) -> str:
    kind = _type_name(field.annotation)
    meaning = _cell(field.description or "")
    return f"| `{variable}` | {kind} | {default} | {meaning} |"


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "")
    return "`" + text.replace("|", "or").replace("pydantic.types.", "") + "`"


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    return "unset" if value is None else f"`{_plain(value)}`"


def _engine_default(name: str) -> str:
    value = engine_defaults().get(name)
    return "the engine's (unset)" if value is None else f"`{_plain(value)}` (the engine's)"


def engine_defaults() -> dict[str, Any]:
    """EngineConfig's field defaults (None where a field has none: it is derived, or required)."""
    defaults: dict[str, Any] = {}
    for field in dataclasses.fields(EngineConfig):
        if field.default is not dataclasses.MISSING:
            defaults[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            defaults[field.name] = field.default_factory()
        else:
            defaults[field.name] = None
    return defaults


def _plain(value: Any) -> str:
    if hasattr(value, "get_secret_value"):
        return "(secret)"
    if value == "":
        return '""'
    if isinstance(value, list | dict):
        return json.dumps(value)
    return str(value)


def _queue_defaults() -> str:
    parts = []
    for queue, limits in default_queues().items():
        values = ", ".join(f"{k} {v}" for k, v in limits.model_dump().items() if v is not None)
        parts.append(f"`{queue}` ({values})")
    return " and ".join(parts)


# --- HTTP API ----------------------------------------------------------------------------------------------


class _NoBroker:
    """The OpenAPI document depends on the routes and models only: nothing is published while it is built."""

    def publish(self, job_id: str, queue: str) -> None:
        raise AssertionError("nothing is published while the OpenAPI document is built")

    def ping(self) -> bool:
        return False


class _NoTokenizer(PromptTokenizer):
    """Building the OpenAPI document counts no tokens, so no model is loaded for it."""

    def __init__(self) -> None:
        pass


def openapi_document() -> dict[str, Any]:
    """The document /openapi.json serves (when the docs are on), from an app built on placeholders: an
    in-memory database nobody opens, no broker, no model."""
    with tempfile.TemporaryDirectory() as data_dir:
        settings = Settings(database_url="sqlite://", data_dir=Path(data_dir), auth_enabled=True,
                            metrics_token=SecretStr("unused"))
        app = create_app(settings, publisher=_NoBroker(), tokenizer=_NoTokenizer())
        return app.openapi()


def routes(document: dict[str, Any]) -> list[tuple[str, str]]:
    """(METHOD, path) of every operation, in the document's order."""
    return [(method.upper(), path) for path, item in document["paths"].items()
            for method in HTTP_METHODS if method in item]


def http_page(document: dict[str, Any]) -> str:
    lines = ["# HTTP API", "",
             f"Every route of the API, rendered from its OpenAPI document when this site was built"
             f" ([openapi.json](openapi.json), version {document['info'].get('version', '')}). A running"
             " service serves the same document and an interactive view at `/docs` when"
             " `CONVEYOR_DOCS_ENABLED` allows. The [jobs API guide](../guides/jobs-api.md) and"
             " [the OpenAI SDK guide](../guides/openai.md) show them in use.", "",
             "| method | path | what it does |", "|---|---|---|"]
    for method, path in routes(document):
        operation = document["paths"][path][method.lower()]
        lines.append(f"| {method} | `{path}` | {_summary(operation)} |")
    return "\n".join(lines) + "\n"


def _summary(operation: dict[str, Any]) -> str:
    text = operation.get("description") or operation.get("summary") or ""
    return _cell(text.strip().split("\n\n")[0])


def _cell(text: str) -> str:
    """Text for one cell of a Markdown table: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


# --- metrics -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportedMetric:
    name: str  # the family name (a counter's without `_total`)
    type: str  # counter | gauge | histogram
    help: str
    where: str  # "worker" (a worker's /metrics, the embedded server's too) or "api"


class _IdleEngine:
    """What WorkerMetrics reads of an EngineHost, for an idle engine: every family it exports appears."""

    def on_request_finished(self, listener: Callable[..., None]) -> None:
        pass

    def on_step_end(self, listener: Callable[[], None]) -> None:
        pass

    def stats(self) -> dict[str, object]:
        queues = {name: 0 for name in default_queues()}
        return stats_dict(running=queues, waiting=queues, kv_blocks_used=0, kv_blocks_total=1, block_size=16,
                          preemptions_total=0, last_step=StepStats(), totals=EngineTotals(),
                          prefix_cache_blocks=0)


def exported_metrics() -> list[ExportedMetric]:
    """Every family a worker and an API export, collected once from their registries (the API's on an empty,
    migrated SQLite store)."""
    worker = WorkerMetrics()
    worker.attach(cast(EngineHost, _IdleEngine()), heartbeat_age_s=lambda: 0.0)
    worker.track_cold_start(ColdStart())
    found = [ExportedMetric(f.name, f.type, f.documentation, "worker") for f in worker.registry.collect()]
    with tempfile.TemporaryDirectory() as data_dir:
        url = f"sqlite:///{Path(data_dir) / 'conveyor.db'}"
        upgrade(url)
        db = make_db_engine(url)
        try:
            api = Metrics(Settings(data_dir=Path(data_dir), database_url=url), make_session_factory(db))
            found += [ExportedMetric(f.name, f.type, f.documentation, "api") for f in api.registry.collect()]
        finally:
            db.dispose()
    return found


def metrics_page(metrics: list[ExportedMetric]) -> str:
    lines = ["# Metrics", "",
             "Every Prometheus metric a worker and the API export, collected from their registries when this"
             " site was built. `worker`: a `conveyor worker` serves them on `CONVEYOR_WORKER_METRICS_PORT`,"
             " `conveyor serve` on its own `/metrics`; `api`: every API process's `/metrics`. Labels, how to"
             " aggregate them, the dashboard and the alerts:"
             " [Metrics, dashboards and alerts](../operations/metrics.md).", "",
             "| name | type | from | help |", "|---|---|---|---|"]
    for metric in sorted(metrics, key=lambda m: (m.where, m.name)):
        name = metric.name + ("_total" if metric.type == "counter" else "")
        lines.append(f"| `{name}` | {metric.type} | {metric.where} | {_cell(metric.help)} |")
    return "\n".join(lines) + "\n"


# --- CLI ---------------------------------------------------------------------------------------------------


def cli_page(app: typer.Typer) -> str:
    runner = CliRunner()
    intro = "Every `conveyor` command with its `--help`, rendered from the code when this site was built."
    lines = ["# CLI", "", intro, ""]
    for path in command_paths(app):
        result = runner.invoke(app, [*path[1:], "--help"], prog_name=" ".join(path),
                               terminal_width=HELP_WIDTH, env={"COLUMNS": str(HELP_WIDTH), "NO_COLOR": "1"})
        assert result.exit_code == 0, f"{' '.join(path)} --help: {result.output}"
        lines += [f"## `{' '.join(path)}`", "", "```text", result.output.strip("\n"), "```", ""]
    return "\n".join(lines)


def command_paths(app: typer.Typer) -> list[tuple[str, ...]]:
    """("conveyor",), ("conveyor", "serve"), ("conveyor", "keys", "create"), ...: every visible command."""
    return [path for path, _ in _commands(typer.main.get_command(app), ("conveyor",))]


def _commands(command: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Typer's own click commands (it vendors click): a group is what has subcommands."""
    yield path, command
    if getattr(command, "commands", None):
        for name in sorted(command.commands):
            sub = command.commands[name]
            if not sub.hidden:
                yield from _commands(sub, (*path, name))
