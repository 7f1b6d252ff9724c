"""A model source's local folder with its metadata (config.json, tokenizer): all the API reads of a model.
The engine adds the weights (engine/model_source.py)."""

from __future__ import annotations

from pathlib import Path

from conveyor.checkpoints.gguf_file import gguf_metadata_folder
from conveyor.checkpoints.hub import hub_snapshot
from conveyor.checkpoints.sources import ModelSource, SourceKind, parse_source

PRESETS_DIR = "presets"  # under the model cache: preset:NAME is built into presets/NAME by the engine


def model_files(source: str | ModelSource, *, cache_dir: Path, revision: str | None = None) -> Path:
    """The local folder holding `source`'s config and tokenizer: a folder as it is, a GGUF file's converted
    folder (its metadata written on first use), a hub id's snapshot (its metadata downloaded when missing), a
    preset's folder (empty until an engine builds it: the API then names it, cli/main.py)."""
    source = parse_source(source) if isinstance(source, str) else source
    if source.kind is SourceKind.FOLDER:
        assert source.path is not None
        return source.path
    if source.kind is SourceKind.GGUF:
        assert source.path is not None
        return gguf_metadata_folder(source.path, cache_dir)
    if source.kind is SourceKind.HUB:
        return hub_snapshot(source.name, revision=revision, weights=False)
    return preset_folder(source.name, cache_dir)


def preset_folder(name: str, cache_dir: Path) -> Path:
    return cache_dir / PRESETS_DIR / name
