"""A model source made a complete local Hugging Face folder, weights included: the metadata from
checkpoints/files.py, then a preset built, a GGUF file's weights dequantized (engine/gguf_weights.py) or a hub
snapshot's weights downloaded. Called before anything reads the folder (LLMEngine, the worker, the bench)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from conveyor.checkpoints.files import model_files, preset_folder
from conveyor.checkpoints.hub import hub_snapshot
from conveyor.checkpoints.sources import ModelSource, SourceKind, parse_source
from conveyor.engine.config import EngineConfig
from conveyor.engine.gguf_weights import gguf_weights
from conveyor.engine.loader import check_model_folder
from conveyor.engine.presets import build_preset

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "conveyor" / "models"


def model_folder(source: str | ModelSource, *, cache_dir: Path | None = None,
                 revision: str | None = None) -> Path:
    """The folder the loader reads for `source`; converted or downloaded on first use into `cache_dir`
    (GGUF files, presets; None: DEFAULT_CACHE_DIR) or the Hugging Face cache (hub ids)."""
    source = parse_source(source) if isinstance(source, str) else source
    cache = cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR
    if source.kind is SourceKind.PRESET:
        return build_preset(source.name, preset_folder(source.name, cache))
    if source.kind is SourceKind.HUB:
        return hub_snapshot(source.name, revision=revision, weights=True)
    folder = model_files(source, cache_dir=cache, revision=revision)
    if source.kind is SourceKind.FOLDER:
        check_model_folder(folder)
    if source.kind is SourceKind.GGUF:
        assert source.path is not None
        gguf_weights(source.path, folder)
    return folder


def with_model_folder(config: EngineConfig) -> EngineConfig:
    """`config` with its model made the local folder it names (unchanged for a folder)."""
    cache = Path(config.model_cache_dir) if config.model_cache_dir else None
    folder = model_folder(config.model, cache_dir=cache, revision=config.revision)
    return dataclasses.replace(config, model=str(folder))
