"""Triton reshape_and_cache (under TRITON_INTERPRET=1) against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels.reference import reshape_and_cache_ref
from conveyor.kernels.triton_cache import reshape_and_cache_triton


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("dtype", "block_size", "num_kv_heads", "head_dim"),
                         [(torch.float32, 16, 2, 64), (torch.float16, 32, 3, 24)])
def test_triton_cache_write_matches_reference(dtype, block_size, num_kv_heads, head_dim, slot_dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    num_blocks = 4
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(6, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(6, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = [block_size * 3 + 5, -1, 0, block_size * 2 - 1, -5, block_size + 2]
    slots = torch.tensor(slots, dtype=slot_dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reshape_and_cache_ref(k, v, expected_k, expected_v, slots)

    reshape_and_cache_triton(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert torch.equal(k_cache[3, 5], k[0]) and torch.equal(v_cache[1, block_size - 1], v[3])


def test_triton_cache_write_from_strided_rows() -> None:
    kv = torch.randn(3, 2, 2, 16)  # [T, k|v, Hkv, D]: k and v as strided views, like a fused projection
    k_cache, v_cache = torch.zeros(2, 16, 2, 16), torch.zeros(2, 16, 2, 16)
    reshape_and_cache_triton(kv[:, 0], kv[:, 1], k_cache, v_cache, torch.tensor([17, 3, -1]))
    assert torch.equal(k_cache[1, 1], kv[0, 0]) and torch.equal(v_cache[0, 3], kv[1, 1])
    assert k_cache.abs().sum() == kv[:2, 0].abs().sum()  # nothing else written


def test_triton_cache_write_rejects_mismatched_rows() -> None:
    with pytest.raises(ValueError, match="k"):
        reshape_and_cache_triton(torch.zeros(2, 3, 16), torch.zeros(2, 3, 16), torch.zeros(2, 16, 2, 16),
                                 torch.zeros(2, 16, 2, 16), torch.tensor([0, 1]))
