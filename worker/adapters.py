"""The LoRA adapters of the model a worker serves, in its engine: those of the configuration
(`[models.ID.adapters]`) loaded when it starts, those loaded at run time (core/store/lora_adapters.py) when a
job first names one, and dropped once unloaded (when no request of the engine holds them any more). A local
PEFT folder is read as it is; an `s3://bucket/prefix/` one is downloaded first under
data_dir/adapters/MODEL/ADAPTER (its two files, adapter_config.json and adapter_model.safetensors)."""

from __future__ import annotations

import logging
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.s3 import make_s3_client, parse_s3_prefix_url
from conveyor.core.settings import Settings
from conveyor.core.store import lora_adapters
from conveyor.engine.host import EngineHost
from conveyor.engine.lora.adapter import CONFIG_FILE, WEIGHTS_FILE

log = logging.getLogger(__name__)
LOAD_TIMEOUT_S = 600.0  # reading one adapter (a few hundred MB at most) into host memory and checking it


def load_adapters(host: EngineHost, settings: Settings) -> list[str]:
    """Adds each adapter of the model to the engine; ValueError naming the adapter that cannot be served
    (the worker does not start half-configured)."""
    loaded = []
    for name, spec in settings.adapters().items():
        folder = _local_folder(settings, name, spec.path)
        try:
            host.add_lora(name, str(folder)).result(timeout=LOAD_TIMEOUT_S)
        except ValueError as exc:
            raise ValueError(f"models.{settings.served_model_id()}.adapters.{name}: {exc}") from None
        log.info("LoRA adapter %s loaded from %s", name, spec.path)
        loaded.append(name)
    return loaded


def _local_folder(settings: Settings, name: str, path: str) -> Path:
    if not path.startswith("s3://"):
        return Path(path)
    target = settings.data_dir / "adapters" / settings.served_model_id() / name
    _download(make_s3_client(settings.s3_endpoint_url, settings.s3_region), path, target)
    return target


def _download(s3: Any, url: str, target: Path) -> None:
    """The adapter's two files under the prefix `url`, into `target` (written whole, then renamed)."""
    location = parse_s3_prefix_url(url)
    target.mkdir(parents=True, exist_ok=True)
    for file_name in (CONFIG_FILE, WEIGHTS_FILE):
        partial = target / (file_name + ".partial")
        s3.download_file(location.bucket, location.key + file_name, str(partial))
        partial.replace(target / file_name)


class RuntimeAdapters:
    """The adapters loaded at run time into this worker's engine (not the configuration's)."""

    def __init__(self, host: EngineHost, sessions: sessionmaker[Session], settings: Settings) -> None:
        self._host, self._sessions, self._settings = host, sessions, settings
        self._configured = set(settings.adapters())
        self._lock = threading.Lock()  # one load at a time: two jobs naming a new adapter load it once
        self._loaded_at: dict[str, datetime] = {}  # the store row (its created_at) each engine copy is of

    def ensure(self, name: str) -> None:
        """Has the engine serve the store's adapter `name` (an adapter unloaded and loaded again under the
        same name is read again); ValueError naming it when the store has none for this model (the job fails
        with it)."""
        if name in self._configured:
            return
        with self._lock:
            with self._sessions() as session:
                row = lora_adapters.get(session, name)
            if row is None or row.model_id != self._settings.served_model_id():
                raise ValueError(f"model: the LoRA adapter `{name}` is not loaded (unloaded since the job "
                                 "was submitted?)")
            in_engine = name in self._host.engine.list_loras()
            if in_engine and self._loaded_at.get(name) == row.created_at:
                return
            if in_engine:  # an earlier registration under the same name: none of its jobs is left
                self._host.remove_lora(name).result(timeout=LOAD_TIMEOUT_S)
            folder = _local_folder(self._settings, name, row.path)
            self._host.add_lora(name, str(folder)).result(timeout=LOAD_TIMEOUT_S)
            self._loaded_at[name] = row.created_at
            log.info("LoRA adapter %s loaded at run time from %s", name, row.path)

    def prune(self) -> list[str]:
        """Drops from the engine the adapters the store no longer has (those still held by a request stay,
        until a later call); returns those dropped."""
        with self._lock:
            loaded = set(self._host.engine.list_loras()) - self._configured
            if not loaded:
                return []
            with self._sessions() as session:
                present = {row.name for row in lora_adapters.all_adapters(session,
                                                                          self._settings.served_model_id())}
            dropped = []
            for name in sorted(loaded - present):
                try:
                    self._host.remove_lora(name).result(timeout=LOAD_TIMEOUT_S)
                except ValueError:  # requests still hold it: the next call tries again
                    continue
                log.info("LoRA adapter %s unloaded", name)
                self._loaded_at.pop(name, None)
                dropped.append(name)
            return dropped
