"""The settings reference: every field of `Settings` and of the per-queue `QueueSettings`, with its type,
default (for the engine's fields, the engine's own) and description."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from conveyor.cli.reference.markdown import cell
from conveyor.core.settings import QueueSettings, Settings, default_queues
from conveyor.engine.config import EngineConfig
from conveyor.worker.model import engine_fields

ENV_PREFIX = "CONVEYOR_"


def settings_page() -> str:
    lines = [
        "# Settings",
        "",
        "Every setting of the one `Settings` object (`core/settings/`), rendered from its field"
        " descriptions when this site was built. Each is read from the environment variable shown, from"
        " the TOML file (`--config` or `CONVEYOR_CONFIG_FILE`, the name without the prefix, in lower case),"
        " or defaults;"
        " [Configuration](../operations/configuration.md) explains precedence and gives an example.",
        "",
        "| variable | type | default | meaning |",
        "|---|---|---|---|",
    ]
    engine_names, defaults = set(engine_fields()), engine_defaults()
    for name, field in Settings.model_fields.items():
        if name == "queues":
            continue
        default = _engine_default(defaults.get(name)) if name in engine_names else _default(field)
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
    meaning = cell(field.description or "")
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


def _engine_default(value: Any) -> str:
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
