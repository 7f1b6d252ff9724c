"""Which model a worker loads, and the engine configuration the service's Settings derive.

One configuration: every Settings field named like an EngineConfig field is passed to the engine when set,
and left to the engine's own default when None, so defaults live in one place (EngineConfig) and no field is
copied by hand. Each queue becomes an engine request class of the same name, limit and priority.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from core.settings import Settings
from engine.config import EngineConfig, RequestClassConfig

log = logging.getLogger(__name__)

# EngineConfig fields the service does not take from Settings: the model comes from resolve_model, the request
# classes from the queues, and the engine's base seed stays its own (jobs carry their own `seed`).
NOT_FROM_SETTINGS = frozenset({"model", "request_classes", "seed"})


def resolve_model(settings: Settings) -> str:
    """settings.model, or (when unset or empty) a tiny random-weight demo model built once under
    data_dir/demo-model."""
    if settings.model:
        return settings.model
    path = settings.model_folder()
    if not (path / "config.json").is_file():
        _build_demo_model(path)
    log.warning(
        "NO MODEL CONFIGURED: using the demo model at %s, which has RANDOM WEIGHTS and writes gibberish. "
        "Set CONVEYOR_MODEL to a Hugging Face model folder for real output.", path,
    )
    return str(path)


def engine_fields() -> list[str]:
    """The EngineConfig fields Settings carries under the same name."""
    return [f.name for f in dataclasses.fields(EngineConfig) if f.name not in NOT_FROM_SETTINGS]


def engine_config(settings: Settings, model_path: str) -> EngineConfig:
    """The engine's configuration: the fields Settings sets, one request class per queue, the model path."""
    given: dict[str, Any] = {}
    for name in engine_fields():
        value = getattr(settings, name)
        if value is not None:
            given[name] = value
    classes = [RequestClassConfig(name=name, max_running=queue.max_running, priority=queue.priority)
               for name, queue in settings.queues.items()]
    return EngineConfig(model=model_path, request_classes=classes, **given)


def _build_demo_model(path: Path) -> None:
    """Builds in a private folder, then renames it into place: no process ever sees half a model."""
    from engine.demo import build_tiny_model

    staging = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    build_tiny_model(staging)
    try:
        staging.rename(path)
    except OSError:  # another process won the race; its copy is identical (the build is seeded)
        shutil.rmtree(staging, ignore_errors=True)
