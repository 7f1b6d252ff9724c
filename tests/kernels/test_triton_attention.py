"""Triton paged attention (under TRITON_INTERPRET=1) against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels.reference import paged_attention_ref
from conveyor.kernels.triton_paged_attention import choose_num_splits, paged_attention_triton

CASES = {
    # name: (query_lens, seq_lens, Hq, Hkv, D, block_size); lengths avoid multiples of the block size
    "decode": ([1, 1, 1, 1], [1, 17, 45, 70], 8, 4, 64, 16),
    "prefill": ([9, 20], [9, 20], 4, 4, 64, 16),
    "mixed_prefill_chunk_decode": ([12, 1, 5, 0, 1, 3], [12, 33, 29, 7, 70, 40], 8, 1, 64, 32),
    "head_dim_128_block_64": ([3, 1, 6], [3, 75, 40], 8, 2, 128, 64),
}


def assert_close_to_reference(batch, got: torch.Tensor, tolerance: float) -> None:
    expected = paged_attention_ref(*batch.args())
    assert got.dtype == expected.dtype and got.shape == expected.shape
    err = (got.float() - expected.float()).abs().max().item()
    assert err <= tolerance, f"max abs error {err:.3g} > {tolerance}"


@pytest.mark.parametrize("num_splits", [1, 3], ids=["no_split", "split3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_triton_matches_reference(paged_batch, tolerance, case, dtype, num_splits) -> None:
    query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size = case
    batch = paged_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
    got = paged_attention_triton(*batch.args(), num_splits=num_splits)
    assert_close_to_reference(batch, got, tolerance[dtype])


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_triton_gqa_ratios(paged_batch, tolerance, group) -> None:
    batch = paged_batch([5, 1], [21, 35], num_heads=8, num_kv_heads=8 // group, head_dim=32, block_size=16)
    assert_close_to_reference(batch, paged_attention_triton(*batch.args()), tolerance[torch.float32])


@pytest.mark.parametrize("num_splits", [1, 2])
def test_triton_decode_batch_with_idle_sequences(paged_batch, tolerance, num_splits) -> None:
    # Sequences with no query this step, first and last included, own no tile.
    batch = paged_batch([0, 1, 0, 1, 0], [4, 18, 9, 33, 12], num_heads=4, num_kv_heads=2, head_dim=16)
    got = paged_attention_triton(*batch.args(), num_splits=num_splits)
    assert_close_to_reference(batch, got, tolerance[torch.float32])


def test_triton_split_kv_long_decode_many_splits(paged_batch, tolerance) -> None:
    # More splits than some sequences have key tiles: empty splits must weigh nothing in the merge.
    batch = paged_batch([1, 1], [300, 20], num_heads=4, num_kv_heads=1, head_dim=16, block_size=16)
    got = paged_attention_triton(*batch.args(), num_splits=5)
    assert_close_to_reference(batch, got, tolerance[torch.float32])


def test_triton_strided_q_into_out_ignoring_table_padding(paged_batch, tolerance) -> None:
    batch = paged_batch([4, 1], [10, 37], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    qkv = torch.cat([batch.q, torch.randn_like(batch.q)], dim=1)  # q as a strided view, like a fused QKV
    batch.q = qkv[:, :4]
    expected = paged_attention_ref(*batch.args())
    batch.block_tables[0, 1:] = 10_000  # past the last block: must not be read
    out = torch.full_like(batch.q, float("nan"))
    got = paged_attention_triton(*batch.args(), out=out)
    assert got is out
    assert (got - expected).abs().max().item() <= tolerance[torch.float32]


def test_triton_odd_head_dim_and_block_size(paged_batch, tolerance) -> None:
    batch = paged_batch([3, 1], [7, 30], num_heads=2, num_kv_heads=1, head_dim=24, block_size=8)
    assert_close_to_reference(batch, paged_attention_triton(*batch.args()), tolerance[torch.float32])


def test_triton_rejects_bad_inputs(paged_batch) -> None:
    batch = paged_batch([1], [5], head_dim=16)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention_triton(*batch.args(), num_splits=0)
    batch.q = batch.q[:, :3]
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_attention_triton(*batch.args())
    wide = paged_batch([1], [5], head_dim=512)
    with pytest.raises(ValueError, match="head dim"):
        paged_attention_triton(*wide.args())


def test_split_heuristic_only_splits_cuda_decodes() -> None:
    cpu = torch.device("cpu")
    assert choose_num_splits(1, 8, 1, 32_768, cpu) == 1
    assert choose_num_splits(1, 8, 4, 32_768, torch.device("cuda")) == 1  # prefill present: no split


def test_triton_accepts_int64_metadata(paged_batch, tolerance) -> None:
    batch = paged_batch([4, 1], [20, 33], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    expected = paged_attention_ref(*batch.args())
    batch.block_tables, batch.seq_lens = batch.block_tables.long(), batch.seq_lens.long()
    batch.query_start_loc = batch.query_start_loc.long()
    got = paged_attention_triton(*batch.args(), num_splits=2)
    assert (got - expected).abs().max().item() <= tolerance[torch.float32]


# Sliding windows and soft-capping, against the dense oracle (conftest.dense_attention).
WINDOW_CASES = {
    # name: (query_lens, seq_lens, Hq, Hkv, D, block_size, window, softcap)
    "decodes_and_chunks_window_5_unaligned": ([1, 6, 1, 3, 0], [40, 6, 23, 30, 9], 4, 2, 16, 8, 5, None),
    "window_above_every_context": ([1, 4], [12, 20], 2, 1, 16, 8, 64, None),
    "window_1": ([1, 5], [17, 5], 2, 1, 16, 8, 1, None),
    "gqa4_window_13": ([3, 1], [35, 50], 8, 2, 16, 16, 13, None),
    "softcap_alone": ([1, 7], [33, 7], 4, 2, 16, 8, None, 0.3),
    "softcap_and_window": ([1, 7, 4], [33, 7, 26], 4, 1, 16, 8, 7, 0.4),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", WINDOW_CASES.values(), ids=WINDOW_CASES.keys())
def test_triton_window_and_softcap_match_the_dense_oracle(
        paged_batch, dense_oracle, tolerance, case, dtype) -> None:
    *shape, window, softcap = case
    batch = paged_batch(*shape, dtype=dtype)
    expected = dense_oracle(batch, window, softcap)
    got = paged_attention_triton(*batch.args(), window=window, softcap=softcap)
    assert got.dtype == dtype
    err = (got.float() - expected.float()).abs().max().item()
    assert err <= tolerance[dtype], f"max abs error {err:.3g}"


def test_triton_long_prefill_chunk_tiles_start_at_their_own_window(
        paged_batch, dense_oracle, tolerance) -> None:
    # 70 queries of one head: two query tiles of 64 rows, the second's window starts 64 keys later.
    batch = paged_batch([70, 1], [90, 40], num_heads=1, num_kv_heads=1, head_dim=16, block_size=16)
    got = paged_attention_triton(*batch.args(), window=9, softcap=1.0)
    assert (got - dense_oracle(batch, 9, 1.0)).abs().max().item() <= tolerance[torch.float32]


@pytest.mark.parametrize("window", [7, 60], ids=["window_7", "window_60"])
def test_triton_split_kv_with_a_window(paged_batch, dense_oracle, tolerance, window) -> None:
    # Splits divide the visible keys only: every split holds some with window 60, most hold none with 7.
    batch = paged_batch([1, 1, 3], [150, 20, 64], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    got = paged_attention_triton(*batch.args(), window=window, softcap=0.5, num_splits=3)
    assert (got - dense_oracle(batch, window, 0.5)).abs().max().item() <= tolerance[torch.float32]


@pytest.mark.parametrize("num_splits", [1, 3], ids=["no_split", "split3"])
@pytest.mark.parametrize("poison", [False, True], ids=["minus_one", "stale_nan_block"])
def test_triton_never_loads_blocks_before_the_window(
        paged_batch, dense_oracle, free_blocks, tolerance, poison, num_splits) -> None:
    window = 11
    batch = paged_batch([1, 4, 1], [70, 30, 41], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
    expected = dense_oracle(batch, window)
    before = paged_attention_triton(*batch.args(), window=window, num_splits=num_splits)
    assert free_blocks(batch, window, poison=poison) >= 10
    got = paged_attention_triton(*batch.args(), window=window, num_splits=num_splits)
    assert torch.equal(got, before)
    assert (got - expected).abs().max().item() <= tolerance[torch.float32]


def test_triton_rejects_a_bad_window_or_softcap(paged_batch) -> None:
    batch = paged_batch([1], [5], head_dim=16)
    with pytest.raises(ValueError, match="window"):
        paged_attention_triton(*batch.args(), window=0)
    with pytest.raises(ValueError, match="softcap"):
        paged_attention_triton(*batch.args(), softcap=-1.0)


def test_split_heuristic_sizes_windowed_decodes_by_their_window(monkeypatch) -> None:
    class Properties:
        multi_processor_count = 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    cuda = torch.device("cuda")
    assert choose_num_splits(1, 8, 1, 32_768, cuda) == 64
    assert choose_num_splits(1, 8, 1, 32_768, cuda, window=1024) == 4  # 1024 keys: 4 splits of 256
    assert choose_num_splits(1, 8, 1, 32_768, cuda, window=100) == 1
