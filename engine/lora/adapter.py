"""A LoRA adapter in Hugging Face PEFT's format, read and checked against the base model it adapts.

A PEFT folder holds `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`, ...) and
`adapter_model.safetensors`, whose tensors are named after the base model's modules:
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` [r, in] and `...lora_B.weight` [out, r].
The modules an adapter targets are read from its tensors (what `target_modules`, a list, a regex or
"all-linear", matched when it was trained), so a config that names modules the weights lack adapts nothing.

The delta of a targeted projection is PEFT's unmerged one: `lora_B(lora_A(x)) * scale`, with scale
`lora_alpha / r` (`lora_alpha / sqrt(r)` under rsLoRA). What PEFT can save but this engine does not apply is
refused with a ValueError naming it (DoRA, trained biases, `modules_to_save`, per-module rank or alpha
patterns, a module outside the seven projections).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target, by PEFT's module name, and their group in our fused layers.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR_NAME = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\."
                          r"(\w+)\.lora_([AB])\.weight$")
_REFUSED_FLAGS = {"use_dora": "DoRA (use_dora)", "modules_to_save": "modules_to_save",
                  "rank_pattern": "per-module ranks (rank_pattern)", "alpha_pattern": "per-module alphas "
                  "(alpha_pattern)", "layer_replication": "layer_replication"}

ModuleWeights = tuple[torch.Tensor, torch.Tensor]  # lora_A [r, in], lora_B [out, r]


@dataclass(frozen=True)
class TargetShape:
    """The base projection's widths: a lora_A is [r, in_features], a lora_B [out_features, r]."""

    in_features: int
    out_features: int


@dataclass
class LoRAAdapter:
    """One adapter's weights on the host, by (layer, projection), and its scale."""

    name: str
    rank: int
    scale: float
    weights: dict[tuple[int, str], ModuleWeights]


def load_adapter(name: str, folder: Path, shapes: dict[str, TargetShape], num_layers: int, max_rank: int,
                 dtype: torch.dtype) -> LoRAAdapter:
    """The adapter in `folder`, checked against the base model (`shapes` by projection, `num_layers`) and
    the engine's `max_rank`; its tensors cast to `dtype`. ValueError naming what is wrong."""
    config = read_config(folder)
    rank, alpha = _rank_and_alpha(config, max_rank)
    file = folder / WEIGHTS_FILE
    if not file.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {file} not found (PEFT saves adapter_model.safetensors)")
    weights = _module_weights(name, load_file(str(file)), shapes, num_layers, rank)
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    cast = {key: (_finite(name, key, "A", a.to(dtype)), _finite(name, key, "B", b.to(dtype)))
            for key, (a, b) in weights.items()}
    return LoRAAdapter(name, rank, scale, cast)


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"LoRA adapter: {path} not found (not a PEFT adapter folder)")
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"LoRA adapter: {path} is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter: {path} must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter: {path}: peft_type {peft_type!r} is not supported (only 'LORA')")
    for key, what in _REFUSED_FLAGS.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter: {path}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter: {path}: bias {config['bias']!r} is not supported (only 'none')")
    return config


def _rank_and_alpha(config: dict[str, Any], max_rank: int) -> tuple[int, float]:
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter: adapter_config.json: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter: rank {rank} exceeds max_lora_rank {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise ValueError(f"LoRA adapter: adapter_config.json: lora_alpha must be a number, got {alpha!r}")
    return rank, float(alpha)


def _module_weights(name: str, tensors: dict[str, torch.Tensor], shapes: dict[str, TargetShape],
                    num_layers: int, rank: int) -> dict[tuple[int, str], ModuleWeights]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        match = _TENSOR_NAME.match(tensor_name)
        if match is None:
            raise ValueError(f"LoRA adapter {name!r}: tensor {tensor_name} is not a LoRA weight of a "
                             f"projection this engine adapts ({', '.join(TARGETS)})")
        layer, target, half = int(match[1]), match[2], match[3]
        if target not in shapes or layer >= num_layers:
            raise ValueError(f"LoRA adapter {name!r}: tensor {tensor_name} targets a module the base model "
                             f"does not have (layers 0-{num_layers - 1}; {', '.join(TARGETS)})")
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"LoRA adapter {name!r}: tensor {tensor_name} holds NaN or infinite values")
        halves.setdefault((layer, target), {})[half] = tensor
    if not halves:
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    return {key: _checked_pair(name, key, pair, shapes[key[1]], rank) for key, pair in halves.items()}


def _finite(name: str, key: tuple[int, str], half: str, weight: torch.Tensor) -> torch.Tensor:
    """`weight` cast to the engine's dtype, refused when a finite value overflowed it (1e5 in float16)."""
    if not bool(torch.isfinite(weight).all()):
        raise ValueError(f"LoRA adapter {name!r}: layers.{key[0]}.{key[1]}.lora_{half} holds values beyond "
                         f"the range of {weight.dtype} (the engine's dtype)")
    return weight


def _checked_pair(name: str, key: tuple[int, str], pair: dict[str, torch.Tensor], shape: TargetShape,
                  rank: int) -> ModuleWeights:
    where = f"LoRA adapter {name!r}: layers.{key[0]}.{key[1]}"
    if set(pair) != {"A", "B"}:
        raise ValueError(f"{where}: has lora_{next(iter(pair))} without lora_{'B' if 'A' in pair else 'A'}")
    a, b = pair["A"], pair["B"]
    if tuple(a.shape) != (rank, shape.in_features) or tuple(b.shape) != (shape.out_features, rank):
        raise ValueError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit rank "
                         f"{rank} and the base projection ({shape.in_features} -> {shape.out_features})")
    return a, b
