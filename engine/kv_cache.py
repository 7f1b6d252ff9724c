"""Sizing and allocating the paged KV cache: per layer, K and V shaped [num_blocks, block_size, Hkv, D].

How many blocks, in order of precedence:
1. `num_kv_blocks` when set (tests use it to force tiny caches);
2. else `kv_cache_memory_bytes` when set;
3. else on CUDA: `gpu_memory_utilization` x device memory, minus what the weights, a profiling forward at
   `max_num_batched_tokens` and non-torch allocations (CUDA context, other processes) take;
4. else on CPU: room for `max_num_seqs` full-length (`max_model_len`) sequences, capped at
   DEFAULT_CPU_KV_CACHE_BYTES (1 GiB) so a long-context model does not swallow the host's memory.
The engine refuses to start when one `max_model_len` sequence cannot fit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention import KVCache
from engine.config import EngineConfig

logger = logging.getLogger("engine")

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class KVCacheLayout:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block in every layer."""
        element_size = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element_size

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def plan_num_blocks(
    config: EngineConfig, layout: KVCacheLayout, max_model_len: int, cuda_available_bytes: int | None = None
) -> int:
    """The number of KV blocks (see the module docstring); ValueError when one max_model_len sequence
    won't fit.

    `cuda_available_bytes`: memory left for the cache after profiling (CUDA only; None elsewhere).
    """
    if config.num_kv_blocks is not None:
        num_blocks, source = config.num_kv_blocks, "num_kv_blocks"
    elif config.kv_cache_memory_bytes is not None:
        num_blocks, source = config.kv_cache_memory_bytes // layout.bytes_per_block, "kv_cache_memory_bytes"
    elif cuda_available_bytes is not None:
        num_blocks = max(cuda_available_bytes, 0) // layout.bytes_per_block
        source = f"gpu_memory_utilization={config.gpu_memory_utilization}"
    else:
        wanted = config.max_num_seqs * layout.blocks_for_tokens(max_model_len)
        num_blocks = min(wanted, DEFAULT_CPU_KV_CACHE_BYTES // layout.bytes_per_block)
        source = f"CPU default (max_num_seqs x max_model_len, at most {DEFAULT_CPU_KV_CACHE_BYTES >> 20} MiB)"
    needed = layout.blocks_for_tokens(max_model_len)
    num_bytes, needed_bytes = num_blocks * layout.bytes_per_block, needed * layout.bytes_per_block
    if num_blocks < needed:
        raise ValueError(
            f"KV cache too small: {num_blocks} blocks ({num_blocks * layout.block_size} tokens, {num_bytes} "
            f"bytes, from {source}) cannot hold one max_model_len={max_model_len} sequence, which needs "
            f"{needed} blocks ({needed_bytes} bytes); give the cache more memory or lower max_model_len")
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s); fits %d sequences of max_model_len=%d",
        num_blocks, layout.block_size, num_blocks * layout.block_size, num_bytes / 2**20, source,
        num_blocks // needed, max_model_len)
    return num_blocks


def cuda_kv_budget_bytes(utilization: float, total: int, free: int, reserved: int, peak: int) -> int:
    """Device memory left for the KV cache: the utilization share of `total`, minus torch's peak during the
    profiling forward (weights + activations) and what torch does not manage (`total - free - reserved`:
    the CUDA context, other processes)."""
    non_torch = (total - free) - reserved
    return int(utilization * total) - peak - non_torch


def allocate_kv_cache(layout: KVCacheLayout, num_blocks: int, device: torch.device) -> list[KVCache]:
    """One (K, V) pair per layer, zero-filled, each [num_blocks, block_size, Hkv, D]."""
    shape = (num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    def buffer() -> torch.Tensor:
        return torch.zeros(shape, dtype=layout.dtype, device=device)

    return [(buffer(), buffer()) for _ in range(layout.num_layers)]
