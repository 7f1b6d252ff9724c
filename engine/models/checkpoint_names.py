"""Where each Hugging Face checkpoint tensor goes in our decoders, and which slices a parameter is filled by.

Our parameters fuse what checkpoints often keep apart: q/k/v in one `qkv_proj`, gate/up in one
`gate_up_proj`, and an MoE layer's experts stacked in `mlp.w_gate_up` [E, 2I, H] / `mlp.w_down` [E, H, I].
A checkpoint tensor therefore lands in a *part* of one parameter:

- `()`: the whole parameter (most tensors; Phi-3's already fused `qkv_proj`/`gate_up_proj`; experts saved
  stacked, as transformers 5 holds them in memory);
- `(shard,)`: one shard of a fused projection's rows (q=0, k=1, v=2; gate=0, up=1);
- `(expert, shard)` / `(expert,)`: one expert's gate or up rows / its down projection.

Expert tensors are named per family: Mixtral `block_sparse_moe.experts.{e}.w1|w3|w2` (gate, up, down) and
`block_sparse_moe.gate` (the router); Qwen2/3-MoE `mlp.experts.{e}.gate_proj|up_proj|down_proj`,
`mlp.gate`, and Qwen2-MoE's `mlp.shared_expert.*` with its `mlp.shared_expert_gate`.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

Part = tuple[int, ...]

# checkpoint name fragment -> (our fused parameter fragment, shard index within it)
PACKED_PARAMS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
EXPERT_SHARDS = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}  # rows of w_gate_up: gate, then up
MOE = r"(?P<layer>.*)\.(?:block_sparse_moe|mlp)"
RULES: list[tuple[re.Pattern[str], str]] = [  # (checkpoint name, our parameter) in order of precedence
    (re.compile(MOE + r"\.experts\.(?P<expert>\d+)\.(?P<proj>w1|w3|gate_proj|up_proj)\.weight$"),
     "mlp.w_gate_up"),
    (re.compile(MOE + r"\.experts\.(?P<expert>\d+)\.(?:w2|down_proj)\.weight$"), "mlp.w_down"),
    (re.compile(MOE + r"\.experts\.gate_up_proj$"), "mlp.w_gate_up"),
    (re.compile(MOE + r"\.experts\.down_proj$"), "mlp.w_down"),
    (re.compile(MOE + r"\.gate\.weight$"), "mlp.gate"),
    (re.compile(MOE + r"\.shared_expert\.(?P<proj>gate_proj|up_proj)\.weight$"), "mlp.shared.gate_up_proj"),
    (re.compile(MOE + r"\.shared_expert\.down_proj\.weight$"), "mlp.shared.down_proj"),
    (re.compile(MOE + r"\.shared_expert_gate\.weight$"), "mlp.shared.gate"),
]


class Target(NamedTuple):
    name: str  # our parameter's name
    part: Part  # which slice of it (see the module docstring)


def checkpoint_target(ckpt_name: str) -> Target:
    """Our parameter and part for a checkpoint tensor name."""
    for pattern, ours in RULES:
        found = pattern.match(ckpt_name)
        if found is None:
            continue
        groups = found.groupdict()
        part: Part = ()
        if groups.get("expert") is not None:
            part = (int(groups["expert"]),)
        if groups.get("proj") is not None:
            part = (*part, EXPERT_SHARDS[groups["proj"]])
        return Target(f"{groups['layer']}.{ours}", part)
    for fragment, (fused, shard) in PACKED_PARAMS.items():
        if f".{fragment}." in ckpt_name:
            return Target(ckpt_name.replace(f".{fragment}.", f".{fused}."), (shard,))
    return Target(ckpt_name, ())


def packed_kind(name: str) -> str | None:
    """"qkv_proj" / "gate_up_proj" for a fused Linear's parameter name (".qkv_proj.weight"), else None."""
    return next((fused for fused, _ in PACKED_PARAMS.values() if f".{fused}." in name), None)


def expected_parts(name: str, param: torch.Tensor, shard_sizes: dict[str, list[int]]) -> set[Part]:
    """Every part that must be loaded to fill `param` (the whole `()` fills them all at once)."""
    if name.endswith("mlp.w_gate_up"):
        return {(e, s) for e in range(param.shape[0]) for s in (0, 1)}
    if name.endswith("mlp.w_down"):
        return {(e,) for e in range(param.shape[0])}
    if name.endswith("mlp.shared.gate_up_proj"):
        return {(0,), (1,)}
    kind = packed_kind(name)
    return {(s,) for s in range(len(shard_sizes[kind]))} if kind else {()}


def param_slice(name: str, param: torch.Tensor, part: Part, shard_sizes: dict[str, list[int]]
                ) -> torch.Tensor:
    """The view of `param` a tensor for `part` is copied into."""
    if part == ():
        return param
    if name.endswith(("mlp.w_gate_up", "mlp.w_down")):
        param, part = param[part[0]], part[1:]  # one expert's [2I, H] or [H, I]
        if not part:
            return param
    kind = packed_kind(name)
    sizes = shard_sizes[kind] if kind else [param.shape[0] // 2] * 2  # gate and up halves
    return param.narrow(0, sum(sizes[:part[0]]), sizes[part[0]])
