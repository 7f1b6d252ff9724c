"""The LoRA adapters of the model a worker serves (`[models.ID.adapters]`), loaded into its engine when it
starts: a local PEFT folder as it is, an `s3://bucket/prefix/` one downloaded first under
data_dir/adapters/MODEL/ADAPTER (its two files, adapter_config.json and adapter_model.safetensors)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from core.s3 import make_s3_client, parse_s3_prefix_url
from core.settings import Settings
from engine.host import EngineHost
from engine.lora.adapter import CONFIG_FILE, WEIGHTS_FILE

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
