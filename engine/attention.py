"""Paged attention as the model layers see it: the step's attention plan and one module per layer.

The layer writes the step's new K/V into its cache slots, then attends over the cache through the block
tables. Both calls go to `kernels/paged_attention.py`, with the step's `AttentionMetadata` and a backend
resolved once, when the model is built.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from conveyor.kernels.metadata import AttentionMetadata
from conveyor.kernels.paged_attention import (
    BACKENDS,
    paged_attention,
    plan_paged_attention,
    reshape_and_cache,
)

KVCache = tuple[torch.Tensor, torch.Tensor]  # K and V, each [num_blocks, block_size, Hkv, D]
# One step's metadata per attention window the model's layers use (None: full attention), each with its plan.
StepAttention = dict[int | None, AttentionMetadata]


def attention_metas(
    meta: AttentionMetadata, k_cache: torch.Tensor, num_heads: int, backend: str, windows: set[int | None],
) -> StepAttention:
    """`meta` with its attention plan for each window, built once per step (a plan's visibility masks
    depend on the window, not on the layer; every layer's cache has `k_cache`'s shape)."""
    return {window: replace(meta, plan=plan_paged_attention(k_cache, meta, num_heads, window=window,
                                                                     backend=backend))
            for window in windows}


class PagedAttention(nn.Module):
    """Causal grouped-query attention over the paged KV cache (no weights: projections live in the model).

    window: keys at positions p - window < k <= p only (sliding-window layers); softcap: scores capped to
    softcap * tanh(score / softcap) (Gemma 2); scale: head_dim ** -0.5 unless the family says otherwise.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: str, *,
                 window: int | None = None, softcap: float | None = None, scale: float | None = None) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        assert backend in BACKENDS, backend
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.backend = backend
        self.window, self.softcap = window, softcap

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: KVCache,
        metas: StepAttention,
    ) -> torch.Tensor:  # [T, Hq, D]
        k_cache, v_cache = kv_cache
        meta = metas[self.window]
        reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, backend=self.backend)
        return paged_attention(q, k_cache, v_cache, meta, self.scale, window=self.window,
                                       softcap=self.softcap, backend=self.backend)
