"""Load a model from a local Hugging Face folder: config.json, *.safetensors (one file or shards), tokenizer.

Weights stream from the safetensors files straight into the model's (uninitialised) parameters, q/k/v,
gate/up and each expert's projections into their slices of the fused parameters
(engine/models/checkpoint_names.py). Every parameter must be filled and every tensor must find a home;
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

from conveyor.checkpoints.sources import ModelSourceError
from conveyor.engine.models import Model, build_model
from conveyor.engine.models.checkpoint_names import Part, checkpoint_target, expected_parts, param_slice
from conveyor.engine.models.llama import LlamaForCausalLM
from conveyor.engine.pooling import resolve_task
from conveyor.engine.quantization import quantize_model, resolve_quantization, weight_bytes

logger = logging.getLogger("conveyor.engine")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # any one of them will do
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)  # recomputed, saved only by old checkpoints
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LoadTimings:
    """Seconds the model runner spent loading, for the worker's cold-start report."""

    weights_s: float  # config, model skeleton and every weight on the device
    kv_cache_s: float  # sizing (on CUDA: a profiling forward) and allocating the KV cache
    # Resolving the attention backend: on CPU, loading the C++ CPU kernels (kernels/cpu_extension.py), or
    # compiling them first (20-40 s) where `python -m conveyor.kernels.prebuild` did not build them ahead.
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


class ModelFolderError(ModelSourceError):
    """The model folder is missing, or lacks a file the engine needs (a ValueError and a FileNotFoundError,
    as every unreadable model source)."""


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
    quantization: str  # "none", "int8" or "int4": how its weights are held


def load_model(
    model_dir: str | Path, device: torch.device, dtype: torch.dtype, attention_backend: str,
    task: str = "generate", quantization: str = "none", kernels: str | None = None,
) -> LoadedModel:
    """The model, ready for `task` ("generate", "embed" or "auto": EngineConfig.task), its weights quantized
    as `quantization` says (EngineConfig.quantization; engine/quantization.py), multiplied by the `kernels`
    backend (kernels/quant_linear.py; None: the attention backend's)."""
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
    parameters = sum(p.numel() for p in model.parameters())
    method = resolve_quantization(quantization, model_dir)
    if method != "none":
        report = quantize_model(model, method, kernels or attention_backend)
        logger.info("quantized %d projections to %s%s", report.quantized, method,
                    f" (kept in {dtype}: {report.kept})" if report.kept else "")
    logger.info("loaded %s (%s) from %d file(s) to %s: %.1f M parameters, %s, weights %.1f MB on %s",
                hf_config["architectures"][0], model_dir, len(files), task, parameters / 1e6,
                dtype if method == "none" else f"{method} ({dtype} activations)", weight_bytes(model) / 1e6,
                device)
    return LoadedModel(model.eval(), hf_config, task, method)


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
    """Fills every parameter from the checkpoint's tensors (engine/models/checkpoint_names.py says which
    part of which parameter each one fills); a ValueError names whatever is missing or left over."""
    params = dict(model.named_parameters())  # a tied lm_head appears once, as model.embed_tokens.weight
    sizes = model.packed_shard_sizes()
    expected = {(name, part) for name, param in params.items() for part in expected_parts(name, param, sizes)}
    loaded: set[tuple[str, Part]] = set()
    unexpected: list[str] = []
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for ckpt_name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if _ignorable(ckpt_name, model):
                    continue
                name, part = _target(ckpt_name, params)
                if name not in params or (part != () and (name, part) not in expected):
                    unexpected.append(ckpt_name)
                    continue
                _copy_into(param_slice(name, params[name], part, sizes), f.get_tensor(ckpt_name), ckpt_name)
                filled = expected_parts(name, params[name], sizes) if part == () else {part}
                loaded.update((name, p) for p in filled)
    missing = sorted(f"{name}{list(part) if part else ''}" for name, part in expected - loaded)
    if "lm_head.weight" in missing:
        raise ValueError("model weights: the checkpoint has no LM head (lm_head.weight), so it cannot "
                         "generate text; serve it for embeddings (task='embed')")
    if missing or unexpected:
        raise ValueError(
            f"model weights: missing {_listed(missing)}; unexpected {_listed(sorted(unexpected))}")


def _target(ckpt_name: str, params: dict[str, torch.nn.Parameter]) -> tuple[str, Part]:
    name, part = checkpoint_target(ckpt_name)
    if name not in params and f"model.{name}" in params:
        name = f"model.{name}"  # a decoder saved without its head: names without "model."
    return name, part


def _listed(names: list[str], most: int = 20) -> str:
    """At most `most` names (an MoE checkpoint of the wrong shape would list thousands)."""
    if not names:
        return "none"
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return f"{names[:most]}{more}"


def _ignorable(ckpt_name: str, model: LlamaForCausalLM) -> bool:
    if ckpt_name.endswith(IGNORED_TENSOR_SUFFIXES):
        return True
    # Some tied checkpoints still carry a copy of the embedding as lm_head.weight; an embedding model has
    # no head at all.
    return ckpt_name == "lm_head.weight" and (model.settings.tie_word_embeddings or model.lm_head is None)


def _copy_into(target: torch.Tensor, tensor: torch.Tensor, ckpt_name: str) -> None:
    if target.shape != tensor.shape:
        raise ValueError(f"model weights: {ckpt_name} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(target.shape)}")
    target.copy_(tensor)
