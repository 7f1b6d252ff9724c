from __future__ import annotations

import logging

import pytest
import torch

from conveyor.engine.config import EngineConfig
from conveyor.engine.kv_cache import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    KVCacheLayout,
    allocate_kv_cache,
    cuda_kv_budget_bytes,
    plan_num_blocks,
)
from conveyor.engine.model_runner import ModelRunner

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
    with caplog.at_level(logging.INFO, logger="conveyor.engine"):
        plan_num_blocks(config(num_kv_blocks=40), LAYOUT, 100)
    message = caplog.text
    assert "40 blocks" in message and "640 tokens" in message
    assert f"{40 * LAYOUT.bytes_per_block / 2**20:.1f} MiB" in message
    assert "fits 5 sequences of max_model_len=100" in message  # 40 // ceil(100 / 16)


def test_a_windowed_model_needs_only_the_blocks_a_sequence_holds_at_once(caplog):
    # Window 16, chunks of 64: a sequence holds at most 1 + ceil((15 + 64 - 1) / 16) = 6 blocks of 16, though
    # max_model_len=1024 spans 64.
    cfg = config(num_kv_blocks=6, max_num_batched_tokens=64)
    with caplog.at_level(logging.INFO, logger="conveyor.engine"):
        assert plan_num_blocks(cfg, LAYOUT, 1024, sliding_window=16) == 6
    assert "fits 1 sequences of max_model_len=1024, 6 blocks each at once (sliding window 16" in caplog.text
    with pytest.raises(ValueError, match=r"5 blocks.*max_model_len=1024 sequence, which needs 6 blocks at "
                                         r"once \(sliding window 16, chunks up to 64 tokens\)"):
        plan_num_blocks(config(num_kv_blocks=5, max_num_batched_tokens=64), LAYOUT, 1024, sliding_window=16)
    with pytest.raises(ValueError, match=r"which needs 64 blocks \("):
        plan_num_blocks(cfg, LAYOUT, 1024)  # no window: every block of the sequence


def test_a_windowed_bound_follows_the_longest_chunk():
    # long_prefill_token_threshold=32 caps a chunk below the step's 2048 tokens: 1 + ceil(46 / 16) = 4.
    assert plan_num_blocks(config(num_kv_blocks=4, long_prefill_token_threshold=32), LAYOUT, 1024,
                           sliding_window=16) == 4
    with pytest.raises(ValueError, match="needs 6 blocks"):  # 0: no cap, so the step's 64 tokens
        plan_num_blocks(config(num_kv_blocks=4, max_num_batched_tokens=64, long_prefill_token_threshold=0),
                        LAYOUT, 1024, sliding_window=16)


def test_cpu_default_fits_max_num_seqs_windowed_sequences():
    # 4 sequences x 6 blocks (window 16, chunks of 64), not 4 x 64.
    assert plan_num_blocks(config(max_num_seqs=4, max_num_batched_tokens=64), LAYOUT, 1024,
                           sliding_window=16) == 24


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


def test_runner_of_a_windowed_model_sizes_the_cache_by_the_window(tiny_model_dir):
    path = tiny_model_dir("MistralForCausalLM", sliding_window=16, max_position_embeddings=1024)
    runner = ModelRunner(EngineConfig(model=str(path), num_kv_blocks=6, max_num_batched_tokens=64,
                                      max_model_len=1024, block_size=16))
    assert runner.kv_sliding_window == 16 and runner.num_kv_blocks == 6
    with pytest.raises(ValueError, match=r"needs 6 blocks at once \(sliding window 16"):
        ModelRunner(EngineConfig(model=str(path), num_kv_blocks=5, max_num_batched_tokens=64,
                                 max_model_len=1024, block_size=16))
