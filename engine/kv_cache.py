"""Sizing and allocating the paged KV cache: per layer, K and V shaped [num_blocks, block_size, Hkv, D].

How many blocks, in order of precedence:
1. `num_kv_blocks` when set (tests use it to force tiny caches);
2. else `kv_cache_memory_bytes` when set;
3. else on CUDA: `gpu_memory_utilization` x device memory, minus what the weights, a profiling forward at
   `max_num_batched_tokens` and non-torch allocations (CUDA context, other processes) take;
4. else on CPU: room for `max_num_seqs` full-length (`max_model_len`) sequences, capped at
   DEFAULT_CPU_KV_CACHE_BYTES (1 GiB) so a long-context model does not swallow the host's memory.
The engine refuses to start when one `max_model_len` sequence cannot fit.

What one sequence needs is the most blocks it ever holds at once
(conveyor.engine.block_manager.max_blocks_held): all of its blocks, or for a model whose every layer attends
within a sliding window, only those of the window and one step's chunk (it releases the others), so a long
context fits a small cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from conveyor.engine.attention import KVCache
from conveyor.engine.block_manager import max_blocks_held, max_chunk_tokens
from conveyor.engine.config import EngineConfig

logger = logging.getLogger("conveyor.engine")

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
    config: EngineConfig, layout: KVCacheLayout, max_model_len: int, cuda_available_bytes: int | None = None,
    *, sliding_window: int | None = None,
) -> int:
    """The number of KV blocks (see the module docstring); ValueError when one max_model_len sequence
    won't fit.

    `cuda_available_bytes`: memory left for the cache after profiling (CUDA only; None elsewhere).
    `sliding_window`: the window every layer attends within (None: some layer attends to everything).
    """
    step = max_chunk_tokens(config)
    per_seq = max_blocks_held(max_model_len, layout.block_size, sliding_window, step)
    num_blocks, source = _sized_num_blocks(config, layout, per_seq, cuda_available_bytes)
    # Both messages say why, with a window, a max_model_len sequence needs fewer blocks than its length.
    held = "" if sliding_window is None else (
        f" at once (sliding window {sliding_window}, chunks up to {step} tokens)")
    num_bytes, needed_bytes = num_blocks * layout.bytes_per_block, per_seq * layout.bytes_per_block
    if num_blocks < per_seq:
        raise ValueError(
            f"KV cache too small: {num_blocks} blocks ({num_blocks * layout.block_size} tokens, {num_bytes} "
            f"bytes, from {source}) cannot hold one max_model_len={max_model_len} sequence, which needs "
            f"{per_seq} blocks{held} ({needed_bytes} bytes); give the cache more memory or lower "
            "max_model_len")
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s); fits %d sequences of max_model_len=%d, "
        "%d blocks each%s", num_blocks, layout.block_size, num_blocks * layout.block_size,
        num_bytes / 2**20, source, num_blocks // per_seq, max_model_len, per_seq, held)
    return num_blocks


def _sized_num_blocks(config: EngineConfig, layout: KVCacheLayout, per_seq: int,
                      cuda_available_bytes: int | None) -> tuple[int, str]:
    """The number of blocks by the first sizing rule that applies, and that rule in words; per_seq: the most
    blocks one max_model_len sequence holds at once."""
    if config.num_kv_blocks is not None:
        num_blocks, source = config.num_kv_blocks, "num_kv_blocks"
    elif config.kv_cache_memory_bytes is not None:
        num_blocks, source = config.kv_cache_memory_bytes // layout.bytes_per_block, "kv_cache_memory_bytes"
    elif cuda_available_bytes is not None:
        num_blocks = max(cuda_available_bytes, 0) // layout.bytes_per_block
        source = f"gpu_memory_utilization={config.gpu_memory_utilization}"
    else:
        num_blocks = min(config.max_num_seqs * per_seq, DEFAULT_CPU_KV_CACHE_BYTES // layout.bytes_per_block)
        source = f"CPU default (max_num_seqs x max_model_len, at most {DEFAULT_CPU_KV_CACHE_BYTES >> 20} MiB)"
    return num_blocks, source


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
