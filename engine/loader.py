"""Load a model from a local Hugging Face folder: config.json, *.safetensors (one file or shards), tokenizer.

Weights stream from the safetensors files straight into the model's (uninitialised) parameters, q/k/v and
gate/up into their fused slices. Every parameter must be filled and every tensor must find a home;
otherwise a ValueError names the culprits.

What the engine serves decides what must be there (engine/pooling.py resolve_task): a generation engine
needs a decoder with its LM head; an embedding engine drops the head (it never computes logits), so it
also takes a decoder saved without one (`Qwen2Model`, ..., tensor names without `model.`, as
sentence-transformers saves them). An encoder (`is_encoder`) loads its weights itself.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open

from engine.models import Model, build_model
from engine.models.llama import PACKED_PARAMS, LlamaForCausalLM
from engine.pooling import resolve_task

logger = logging.getLogger("engine")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # any one of them will do
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)  # recomputed, saved only by old checkpoints
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LoadTimings:
    """Seconds the model runner spent loading, for the worker's cold-start report."""

    weights_s: float  # config, model skeleton and every weight on the device
    kv_cache_s: float  # sizing (on CUDA: a profiling forward) and allocating the KV cache
    # Resolving the attention backend: on CPU, loading the C++ CPU kernels (kernels/cpu_extension.py), or
    # compiling them first (20-40 s) where `python -m kernels.prebuild` did not build them ahead.
    attention_s: float = 0.0


def resolve_device(device: str) -> torch.device:
    """"auto" -> cuda when available, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """"auto" -> bfloat16 on CUDA, float32 elsewhere (bf16 matmuls are very slow on CPU)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {list(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


class ModelFolderError(FileNotFoundError, ValueError):
    """The model folder is missing, or lacks a file the engine needs. A ValueError like every bad engine
    argument, and still the FileNotFoundError that callers of the loader have always caught."""


def check_model_folder(model_dir: str | Path) -> Path:
    """The folder, checked first so that a mistyped path is named as such, not as a missing file in it."""
    path = Path(model_dir)
    if not path.exists():
        raise ModelFolderError(f"model folder {path} does not exist")
    if not path.is_dir():
        raise ModelFolderError(f"model folder {path} is not a folder")
    return path


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = check_model_folder(model_dir)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelFolderError(f"model: no config.json in {str(path)!r}")
    return json.loads(config_file.read_text())


def check_tokenizer_files(model_dir: str | Path) -> None:
    path = check_model_folder(model_dir)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelFolderError(f"model: no tokenizer file ({' or '.join(TOKENIZER_FILES)}) in {str(path)!r}")


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The weight files: those model.safetensors.index.json lists when present, else every *.safetensors."""
    path = Path(model_dir)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ModelFolderError(f"model: {index.name} lists missing shard(s) {missing} in {str(path)!r}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFolderError(f"model: no *.safetensors weight file in {str(path)!r}")
    return files


class LoadedModel(NamedTuple):
    model: Model  # every weight loaded, in eval mode
    hf_config: dict[str, Any]  # the raw config.json
    task: str  # "generate" or "embed": what the engine serves with it


def load_model(
    model_dir: str | Path, device: torch.device, dtype: torch.dtype, attention_backend: str,
    task: str = "generate",
) -> LoadedModel:
    """The model, ready for `task` ("generate", "embed" or "auto": EngineConfig.task)."""
    hf_config = read_hf_config(model_dir)
    files = safetensors_files(model_dir)
    with torch.device(device):
        model = build_model(hf_config, dtype, attention_backend)
    is_encoder = getattr(model, "is_encoder", False)
    task = resolve_task(task, model_dir, is_encoder=is_encoder, has_lm_head=has_lm_head(hf_config))
    if is_encoder:
        model.load_weights(files)
    else:
        assert isinstance(model, LlamaForCausalLM)
        if task == "embed":
            model.lm_head = None  # an embedding needs no logits: the head's memory is not kept
        load_weights(model, files)
    logger.info("loaded %s (%s) from %d file(s) to %s: %.1f M parameters, %s on %s",
                hf_config["architectures"][0], model_dir, len(files), task,
                sum(p.numel() for p in model.parameters()) / 1e6, dtype, device)
    return LoadedModel(model.eval(), hf_config, task)


def has_lm_head(hf_config: dict[str, Any]) -> bool:
    """Whether the checkpoint's architecture carries an LM head (a *ForCausalLM); `LlamaModel` and the
    like are decoders saved without one, for embeddings."""
    return any(arch.endswith("ForCausalLM") for arch in hf_config.get("architectures") or [])


def is_encoder_config(hf_config: dict[str, Any]) -> bool:
    """Whether config.json names an encoder: the model is built on the meta device (no memory) to ask it."""
    with torch.device("meta"):
        return bool(getattr(build_model(hf_config, torch.float32, "torch"), "is_encoder", False))


@torch.no_grad()
def load_weights(model: LlamaForCausalLM, files: list[Path]) -> None:
    params = dict(model.named_parameters())  # a tied lm_head appears once, as model.embed_tokens.weight
    shard_sizes = model.packed_shard_sizes()
    expected = {(name, shard) for name, param in params.items()
                for shard in range(len(shard_sizes.get(_packed_kind(name), [None])))}
    loaded: set[tuple[str, int]] = set()
    unexpected: list[str] = []
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for ckpt_name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if _ignorable(ckpt_name, model):
                    continue
                name, shard = _our_name(ckpt_name)
                if name not in params and f"model.{name}" in params:
                    name = f"model.{name}"  # a decoder saved without its head: names without "model."
                if name not in params:
                    unexpected.append(ckpt_name)
                    continue
                _copy_into(params[name], shard, shard_sizes.get(_packed_kind(name)), f.get_tensor(ckpt_name),
                           ckpt_name)
                loaded.add((name, shard))
    missing = sorted(f"{name}[{shard}]" if _packed_kind(name) else name for name, shard in expected - loaded)
    if "lm_head.weight" in missing:
        raise ValueError("model weights: the checkpoint has no LM head (lm_head.weight), so it cannot "
                         "generate text; serve it for embeddings (task='embed')")
    if missing or unexpected:
        raise ValueError(
            f"model weights: missing {missing or 'none'}; unexpected {sorted(unexpected) or 'none'}")


def _ignorable(ckpt_name: str, model: LlamaForCausalLM) -> bool:
    if ckpt_name.endswith(IGNORED_TENSOR_SUFFIXES):
        return True
    # Some tied checkpoints still carry a copy of the embedding as lm_head.weight; an embedding model has
    # no head at all.
    return ckpt_name == "lm_head.weight" and (model.settings.tie_word_embeddings or model.lm_head is None)


def _our_name(ckpt_name: str) -> tuple[str, int]:
    """Checkpoint tensor name -> (our parameter name, shard index inside a fused parameter, else 0)."""
    for part, (fused, shard) in PACKED_PARAMS.items():
        if f".{part}." in ckpt_name:
            return ckpt_name.replace(f".{part}.", f".{fused}."), shard
    return ckpt_name, 0


def _packed_kind(name: str) -> str | None:
    """"qkv_proj" / "gate_up_proj" for a fused parameter's name, else None."""
    return next((fused for fused, _ in PACKED_PARAMS.values() if f".{fused}." in name), None)


def _copy_into(
    param: torch.Tensor, shard: int, sizes: list[int] | None, tensor: torch.Tensor, ckpt_name: str
) -> None:
    target = param
    if sizes is not None:  # a fused parameter: the shard's rows
        start = sum(sizes[:shard])
        target = param.narrow(0, start, sizes[shard])
    if target.shape != tensor.shape:
        raise ValueError(f"model weights: {ckpt_name} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(target.shape)}")
    target.copy_(tensor)
