from __future__ import annotations

import logging

import pytest
import torch

from engine.config import EngineConfig
from engine.kv_cache import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    KVCacheLayout,
    allocate_kv_cache,
    cuda_kv_budget_bytes,
    plan_num_blocks,
)
from engine.model_runner import ModelRunner

# The default tiny Llama: 2 layers, 2 KV heads of dim 16, fp32 -> 2 * 2 * 16 * 2 * 16 * 4 = 8192 B per block.
LAYOUT = KVCacheLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=16, dtype=torch.float32)


def config(**kwargs) -> EngineConfig:
    return EngineConfig(model="unused", **kwargs)


def test_bytes_per_block_counts_k_and_v_of_every_layer():
    assert LAYOUT.bytes_per_block == 2 * 2 * 16 * 2 * 16 * 4
    half = KVCacheLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    assert half.bytes_per_block == LAYOUT.bytes_per_block // 2


def test_num_kv_blocks_overrides_the_memory_budget():
    assert plan_num_blocks(config(num_kv_blocks=37, kv_cache_memory_bytes=1 << 30), LAYOUT, 256) == 37


def test_kv_cache_memory_bytes_is_divided_by_the_block_size_in_bytes():
    budget = 100 * LAYOUT.bytes_per_block + LAYOUT.bytes_per_block - 1  # a partial block does not count
    assert plan_num_blocks(config(kv_cache_memory_bytes=budget), LAYOUT, 256) == 100


def test_cuda_budget_is_used_when_nothing_else_is_set():
    assert plan_num_blocks(config(), LAYOUT, 256, cuda_available_bytes=50 * LAYOUT.bytes_per_block) == 50


def test_cuda_budget_subtracts_the_profiled_peak_and_memory_torch_does_not_manage():
    gib = 2**30
    # 80 GiB device, 0.9 -> 72 GiB; torch peaked at 20 GiB (weights + activations); 1 GiB of the 60 GiB in use
    # is neither reserved by torch (59 GiB) -> CUDA context or another process.
    assert cuda_kv_budget_bytes(0.9, total=80 * gib, free=20 * gib, reserved=59 * gib, peak=20 * gib) == (
        int(0.9 * 80 * gib) - 20 * gib - 1 * gib)


def test_cpu_default_fits_max_num_seqs_full_sequences():
    # 4 sequences x ceil(100 / 16) = 7 blocks each.
    assert plan_num_blocks(config(max_num_seqs=4), LAYOUT, 100) == 28


def test_cpu_default_is_capped():
    big = KVCacheLayout(num_layers=64, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.float32)
    blocks = plan_num_blocks(config(max_num_seqs=256), big, 1024)  # 8 MiB blocks: 256 x 64 wanted
    assert blocks == DEFAULT_CPU_KV_CACHE_BYTES // big.bytes_per_block


def test_refuses_when_one_max_model_len_sequence_cannot_fit():
    with pytest.raises(ValueError, match=r"3 blocks.*max_model_len=64.*needs 4 blocks"):
        plan_num_blocks(config(num_kv_blocks=3), LAYOUT, 64)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        plan_num_blocks(config(kv_cache_memory_bytes=LAYOUT.bytes_per_block), LAYOUT, 64)
    assert plan_num_blocks(config(num_kv_blocks=4), LAYOUT, 64) == 4


def test_logs_blocks_tokens_bytes_and_sequences_that_fit(caplog):
    with caplog.at_level(logging.INFO, logger="engine"):
        plan_num_blocks(config(num_kv_blocks=40), LAYOUT, 100)
    message = caplog.text
    assert "40 blocks" in message and "640 tokens" in message
    assert f"{40 * LAYOUT.bytes_per_block / 2**20:.1f} MiB" in message
    assert "fits 5 sequences of max_model_len=100" in message  # 40 // ceil(100 / 16)


def test_allocated_tensors_have_the_paged_layout():
    caches = allocate_kv_cache(LAYOUT, 9, torch.device("cpu"))
    assert len(caches) == LAYOUT.num_layers
    for k, v in caches:
        assert k.shape == v.shape == (9, 16, 2, 16)
        assert k.dtype == torch.float32
        assert k.data_ptr() != v.data_ptr()


def test_runner_allocates_what_it_planned(llama_dir):
    runner = ModelRunner(EngineConfig(model=str(llama_dir), kv_cache_memory_bytes=70 * LAYOUT.bytes_per_block,
                                      max_model_len=512, block_size=16))
    assert runner.num_kv_blocks == 70
    assert len(runner.kv_caches) == 2
    assert all(k.shape == (70, 16, 2, 16) for k, _ in runner.kv_caches)


def test_runner_refuses_a_cache_too_small_for_max_model_len(llama_dir):
    with pytest.raises(ValueError, match="max_model_len=1024"):
        ModelRunner(EngineConfig(model=str(llama_dir), num_kv_blocks=10))
