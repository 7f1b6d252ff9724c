"""Paged attention as the model layers see it: the step's attention plan and one module per layer.

The layer writes the step's new K/V into its cache slots, then attends over the cache through the block
tables. Both calls go to `kernels`, with the step's `kernels.AttentionMetadata` and a backend resolved once,
when the model is built.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

import kernels
from kernels import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]  # K and V, each [num_blocks, block_size, Hkv, D]


def with_attention_plan(
    meta: AttentionMetadata, k_cache: torch.Tensor, num_heads: int, backend: str
) -> AttentionMetadata:
    """`meta` with its attention plan, built once per step (every layer's cache has `k_cache`'s shape)."""
    return replace(meta, plan=kernels.plan_paged_attention(k_cache, meta, num_heads, backend=backend))


class PagedAttention(nn.Module):
    """Causal grouped-query attention over the paged KV cache (no weights: projections live in the model)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: str) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        assert backend in kernels.BACKENDS, backend
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.backend = backend

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, Hq, D]
        k_cache, v_cache = kv_cache
        kernels.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, backend=self.backend)
        return kernels.paged_attention(q, k_cache, v_cache, meta, self.scale, backend=self.backend)
