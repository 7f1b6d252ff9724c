"""Mixture-of-experts expert computation for the MoE layers (Mixtral, Qwen2-MoE, Qwen3-MoE): one dispatch
point, a fused Triton grouped GEMM on CUDA and the grouped PyTorch reference on CPU.

Contract (every backend):

- `fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, *, backend=None) -> out`, after routing:
  `out[t] = sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])`, each expert a SwiGLU MLP
  `down(silu(gate(x)) * up(x))`.
  - x [T, H]; w_gate_up [E, 2I, H] (rows 0..I-1 the gate projection, I..2I-1 the up projection, as
    F.linear weights); w_down [E, H, I]; the three of one floating dtype, on one device.
  - topk_weights [T, K], any float dtype (the combine over K runs in fp32); topk_ids [T, K] int64 or int32,
    values in [0, E).
  - out [T, H] in x's dtype.
- `expert_token_counts(topk_ids, num_experts) -> [E] int64`: the (token, k) pairs each expert receives
  (load-balancing stats), on the ids' device without a host sync.

Why sorted and grouped: a token's K experts differ from its neighbours', so a per-token loop would run
T * K matrix-vector products that reread each expert's weights once per token. Both backends instead sort
the T * K (token, k) pairs by expert, so each expert multiplies all its rows at once (one weight read per
row tile) and the results are scattered back to their tokens. The Triton kernels pad each expert's segment
to whole row tiles so that a tile never mixes experts; see kernels/moe_reference.py and
kernels/triton_moe.py.

`backend`: None or "auto" picks Triton for CUDA tensors and the reference on CPU; "torch" forces the
reference on any device; "triton" forces Triton (on CPU tensors only with TRITON_INTERPRET=1 set before
triton is imported; else a ValueError); anything else is a ValueError. The Triton module is imported only
when first dispatched to, so CPU users need not install triton.

Checks: wrong ranks, shapes, dtypes or devices raise ValueError naming the argument (no device sync). The
reference also checks the expert ids' values; the Triton path trusts them.
"""

from __future__ import annotations

import torch

from conveyor.kernels.moe_reference import expert_token_counts, fused_moe_ref

MOE_BACKENDS = ("triton", "torch")

__all__ = ["MOE_BACKENDS", "expert_token_counts", "fused_moe", "fused_moe_ref", "resolve_moe_backend"]


def resolve_moe_backend(backend: str | None, device: torch.device) -> str:
    """The backend for `device`: the forced one, else Triton on CUDA and the reference elsewhere."""
    if backend is None or backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend not in MOE_BACKENDS:
        raise ValueError(f"backend must be one of {MOE_BACKENDS}, 'auto' or None, got {backend!r}")
    return backend


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """out [T, H] in x's dtype: see the module docstring."""
    if resolve_moe_backend(backend, x.device) == "torch":
        return fused_moe_ref(x, w_gate_up, w_down, topk_weights, topk_ids)
    from conveyor.kernels.triton_moe import fused_moe_triton

    return fused_moe_triton(x, w_gate_up, w_down, topk_weights, topk_ids)
