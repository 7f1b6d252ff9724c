"""Kernel tests run the Triton kernels on the CPU through the interpreter.

TRITON_INTERPRET must be set before any `@triton.jit` kernel module is imported, hence before the imports.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from conveyor.kernels.cpu_extension import CpuKernels, cpu_kernels
from conveyor.kernels.metadata import AttentionMetadata
from conveyor.kernels.reference import AttentionPlan

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3}


@pytest.fixture(scope="session")
def built() -> CpuKernels:
    """The C++ CPU extension, for the tests of its kernels; they skip where it cannot be built, which
    test_cpu_extension.py's build test reports as a failure."""
    built = cpu_kernels()
    if built.module is None:
        pytest.skip(f"the C++ CPU kernels cannot be built here: {built.detail}")
    return built


@dataclass
class PagedBatch:
    """One step's attention inputs: queries plus a paged cache reached through a shuffled block table.

    The metadata fields stay separate (tests replace or corrupt one at a time); `meta()` assembles them.
    """

    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [T] int64: each query token's own slot
    block_tables: torch.Tensor  # [S, max_blocks] int32, unused entries -1
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    max_query_len: int
    max_seq_len: int
    scale: float

    def meta(self, plan: AttentionPlan | None = None) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping, block_tables=self.block_tables,
                                 seq_lens=self.seq_lens, query_start_loc=self.query_start_loc,
                                 max_query_len=self.max_query_len, max_seq_len=self.max_seq_len, plan=plan)

    def args(
        self, plan: AttentionPlan | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float]:
        """Positional arguments of every paged-attention entry point: (q, k_cache, v_cache, meta, scale)."""
        return (self.q, self.k_cache, self.v_cache, self.meta(plan), self.scale)


def build_paged_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedBatch:
    """Every cache block (used or not) holds random values in [-1, 1), so a read of a wrong slot shows."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2  # two spare blocks nobody owns

    def uniform(*shape: int) -> torch.Tensor:
        return (torch.rand(*shape, generator=gen) * 2 - 1).to(dtype)

    physical = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_table = torch.full((len(seq_lens), max(blocks_per_seq)), -1, dtype=torch.int32)
    first = 0
    for s, count in enumerate(blocks_per_seq):
        block_table[s, :count] = physical[first:first + count]
        first += count
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    table = block_table.tolist()
    slots = [table[s][pos // block_size] * block_size + pos % block_size
             for s, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True))
             for pos in range(seq_len - query_len, seq_len)]  # [T]: this step's tokens are the last ones
    return PagedBatch(
        q=uniform(starts[-1], num_heads, head_dim),
        k_cache=uniform(num_blocks, block_size, num_kv_heads, head_dim),
        v_cache=uniform(num_blocks, block_size, num_kv_heads, head_dim),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=block_table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        scale=head_dim ** -0.5,
    )


def dense_attention(
    batch: PagedBatch, window: int | None = None, softcap: float | None = None
) -> torch.Tensor:
    """[T, Hq, D] in q's dtype: the independent oracle, nothing shared with the backends. Each sequence's
    whole K/V is copied out of the cache (fp64), every score computed (`scale * q.k`), soft-capped
    (`softcap * tanh(score / softcap)`, transformers' Gemma 2 eager order), masked (causal, and with a window
    transformers' `sliding_window_causal_mask_function`: the query at p sees keys k with p - window < k <= p)
    and softmaxed. Reads every block of every sequence: call it before freeing any."""
    out = torch.zeros(batch.q.shape, dtype=torch.float64)
    block_size = batch.k_cache.shape[1]
    group = batch.q.shape[1] // batch.k_cache.shape[2]
    starts = batch.query_start_loc.tolist()
    for s, seq_len in enumerate(batch.seq_lens.tolist()):
        begin, end = starts[s], starts[s + 1]
        if begin == end:
            continue
        keys = torch.arange(seq_len)  # [L] positions
        blocks = batch.block_tables[s, keys // block_size].long()
        k = batch.k_cache[blocks, keys % block_size].double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = batch.v_cache[blocks, keys % block_size].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", batch.q[begin:end].double(), k) * batch.scale  # [Hq, Q, L]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        queries = seq_len - (end - begin) + torch.arange(end - begin)  # [Q] positions
        visible = keys[None, :] <= queries[:, None]  # [Q, L]
        if window is not None:
            visible &= keys[None, :] > queries[:, None] - window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)  # [Hq, Q, L]
        out[begin:end] = torch.einsum("hqk,khd->qhd", probs, v)
    return out.to(batch.q.dtype)


def free_blocks_before_window(batch: PagedBatch, window: int, poison: bool = False) -> int:
    """Overwrites, as the engine may once it frees them, the block-table entries of blocks wholly before each
    sequence's window (no query of the step sees a key in them) with -1, or with `poison` the id of a block
    appended to both caches and full of NaN: a backend that loads one shows NaN. Returns how many."""
    block_size, starts = batch.k_cache.shape[1], batch.query_start_loc.tolist()
    stale = -1
    if poison:
        stale = batch.k_cache.shape[0]
        nan_block = torch.full_like(batch.k_cache[:1], float("nan"))  # [1, block_size, Hkv, D]
        batch.k_cache = torch.cat([batch.k_cache, nan_block])
        batch.v_cache = torch.cat([batch.v_cache, nan_block])
    freed = 0
    for s, seq_len in enumerate(batch.seq_lens.tolist()):
        first_query = seq_len - (starts[s + 1] - starts[s])
        unseen_blocks = max(0, first_query - window + 1) // block_size
        batch.block_tables[s, :unseen_blocks] = stale
        freed += unseen_blocks
    return freed


@pytest.fixture
def paged_batch() -> Callable[..., PagedBatch]:
    return build_paged_batch


@pytest.fixture
def dense_oracle() -> Callable[..., torch.Tensor]:
    """`dense_attention(batch, window=None, softcap=None)`: the oracle of sliding windows and soft-capping."""
    return dense_attention


@pytest.fixture
def free_blocks() -> Callable[..., int]:
    """`free_blocks_before_window(batch, window, poison=False) -> count`."""
    return free_blocks_before_window


@pytest.fixture
def tolerance() -> dict[torch.dtype, float]:
    return TOLERANCE
