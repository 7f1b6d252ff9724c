"""GGUF files (llama.cpp's format): what the engine reads of them, checked at load, and their config and
tokenizer written out as a Hugging Face folder by transformers' own GGUF support (the weights: engine/
gguf_weights.py). One folder per file in the model cache, keyed by the file's content, so that a changed
file is converted again."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from conveyor.checkpoints.sources import GGUF_SUFFIX, ModelSourceError

# general.architecture values whose transformers class the engine builds (mistral is "llama" in GGUF).
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
# Tensor types dequantized by the gguf package and checked here; the IQ and ternary types are refused,
# untried.
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# The engine's weight-only quantization closest to each quantized type (engine/quantization.py): a file runs
# with the one of its most common type. Q4_0, Q4_1 and Q8_0 are those layouts exactly; the others requantized.
QUANTIZATION_OF_TYPE = {"Q8_0": "int8", "Q6_K": "int8", "Q5_0": "int8", "Q5_1": "int8", "Q5_K": "int8",
                        "Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4"}
KEY_BYTES = 2**20  # read from each end of a GGUF file for its folder's key
META_DONE = "conveyor-gguf.json"  # written last into a converted folder's metadata


@dataclass(frozen=True)
class GgufSummary:
    architecture: str
    tensor_types: dict[str, int]  # type name -> tensors of it
    name: str  # general.name, "" when absent


def check_gguf(path: Path) -> GgufSummary:
    """The file's architecture and tensor types, each checked against what the engine reads: an unsupported
    one is a ModelSourceError naming it (and a tensor of that type)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise ModelSourceError(f"model: {path} is not a readable GGUF file ({exc})") from exc
    architecture = _field(reader, "general.architecture")
    if architecture not in ARCHITECTURES:
        raise ModelSourceError(f"model: {path.name}: GGUF architecture {architecture!r} is not supported; "
                               f"supported: {', '.join(ARCHITECTURES)}")
    if int(_field(reader, f"{architecture}.expert_count") or 0) > 0:
        raise ModelSourceError(f"model: {path.name}: a {architecture} GGUF with experts (mixture of experts) "
                               "is not supported; load its Hugging Face folder instead")
    types = Counter(t.tensor_type.name for t in reader.tensors)
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in TENSOR_TYPES:
            raise ModelSourceError(
                f"model: {path.name}: GGUF tensor type {tensor.tensor_type.name} (tensor {tensor.name!r}) is "
                f"not supported; supported: {', '.join(TENSOR_TYPES)}")
    return GgufSummary(architecture, dict(types), str(_field(reader, "general.name") or ""))


def gguf_quantization(folder: Path) -> str | None:
    """The quantization ("int8", "int4" or "none") a folder converted from a GGUF file runs with by default:
    that of its most common quantized tensor type; None: the folder is not a converted GGUF file."""
    done = folder / META_DONE
    if not done.is_file():
        return None
    types: dict[str, int] = json.loads(done.read_text())["tensor_types"]
    quantized = {name: count for name, count in types.items() if name in QUANTIZATION_OF_TYPE}
    if not quantized:
        return "none"
    return QUANTIZATION_OF_TYPE[max(quantized, key=lambda name: quantized[name])]


def converted_folder(path: Path, cache_dir: Path) -> Path:
    """Where `path` is (or will be) converted: <cache>/gguf/<file name>-<key of its size and its first and
    last MiB>. The key reads the content, not the path or time: an API and a worker in two images that each
    installed the same file find the same folder in their shared data_dir."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as file:
        digest.update(file.read(KEY_BYTES))
        file.seek(max(size - KEY_BYTES, 0))
        digest.update(file.read(KEY_BYTES))
    return cache_dir / "gguf" / f"{path.name.removesuffix(GGUF_SUFFIX)}-{digest.hexdigest()[:16]}"


def gguf_metadata_folder(path: Path, cache_dir: Path) -> Path:
    """The converted folder with config.json, generation_config.json and the tokenizer (chat template
    included), written once: checked, converted aside, then renamed into place under a lock, so that an API
    and a worker starting together convert it once and neither sees half a folder."""
    from filelock import FileLock

    folder = converted_folder(path, cache_dir)
    if (folder / META_DONE).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{folder}.lock"):
        if (folder / META_DONE).is_file():
            return folder
        summary = check_gguf(path)
        staging = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        try:
            _write_metadata(path, staging)
        except ImportError as exc:  # transformers reads GGUF files only with torch installed
            raise ModelSourceError(
                f"model: {path.name} is not converted yet in {cache_dir} and this process cannot convert it "
                f"({exc}); start a worker on the same data_dir first (it converts it), then this one"
            ) from None
        done = {"gguf": path.name, "architecture": summary.architecture, "tensor_types": summary.tensor_types}
        (staging / META_DONE).write_text(json.dumps(done) + "\n")
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
    return folder


def _write_metadata(path: Path, out: Path) -> None:
    """config.json (with `architectures`, which a GGUF does not record), generation_config.json (its bos, eos
    and pad ids) and the tokenizer, as transformers reads them from the file."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)


def _field(reader: object, key: str) -> object:
    field = reader.fields.get(key)  # type: ignore[attr-defined]
    return field.contents() if field is not None else None
