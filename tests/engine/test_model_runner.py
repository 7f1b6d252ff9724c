from __future__ import annotations

import pytest
import torch

from conveyor.engine.config import EngineConfig
from conveyor.engine.kv_cache import KVCacheLayout
from conveyor.engine.model_runner import (
    ModelRunner,
    prepare_step,
    profiling_chunks,
    resolve_max_model_len,
)
from conveyor.engine.scheduled_chunk import ScheduledChunk
from conveyor.kernels import reference
from conveyor.kernels.paged_attention import AttentionMetadata

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def runner(llama_dir) -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(llama_dir), num_kv_blocks=40, max_model_len=256))


def test_runner_exposes_what_the_engine_needs(runner, llama_dir):
    assert runner.vocab_size == 512
    assert runner.block_size == 16
    assert runner.max_model_len == 256
    assert runner.num_kv_blocks == 40
    assert runner.device == CPU
    assert runner.dtype == torch.float32
    assert runner.attention_backend == "cpu"  # auto on CPU, where the C++ CPU kernels build (CI machines)
    assert runner.hf_config["architectures"] == ["LlamaForCausalLM"]


def test_max_model_len_defaults_to_max_position_embeddings(llama_dir):
    assert ModelRunner(EngineConfig(model=str(llama_dir), num_kv_blocks=64)).max_model_len == 1024


def test_max_model_len_beyond_the_model_is_refused(llama_dir):
    with pytest.raises(ValueError, match=r"max_model_len=2048.*max_position_embeddings=1024"):
        ModelRunner(EngineConfig(model=str(llama_dir), num_kv_blocks=200, max_model_len=2048))


def test_a_sliding_window_does_not_cap_max_model_len():
    mistral = {"max_position_embeddings": 4096, "sliding_window": 1024}
    assert resolve_max_model_len(None, mistral) == 4096
    assert resolve_max_model_len(512, mistral) == 512


def test_prepare_step_flattens_chunks_into_tensors():
    chunks = [
        ScheduledChunk([11, 12, 13], start_pos=0, block_table=[4, 1], sample=True),  # a prefill
        ScheduledChunk([21], start_pos=17, block_table=[2, 7], sample=True),  # a decode in its 2nd block
        ScheduledChunk([31, 32], start_pos=15, block_table=[5, 3, 9], sample=False),  # chunk across blocks
    ]
    step = prepare_step(chunks, block_size=16, device=CPU)
    assert step.input_ids.tolist() == [11, 12, 13, 21, 31, 32]
    assert step.positions.tolist() == [0, 1, 2, 17, 15, 16]
    assert isinstance(step.meta, AttentionMetadata) and step.meta.plan is None
    assert step.meta.slot_mapping.tolist() == [64, 65, 66, 7 * 16 + 1, 5 * 16 + 15, 3 * 16 + 0]
    assert step.meta.block_tables.tolist() == [[4, 1, 0], [2, 7, 0], [5, 3, 9]]
    assert step.meta.block_tables.dtype == torch.int32
    assert step.meta.seq_lens.tolist() == [3, 18, 17]
    assert step.meta.query_start_loc.tolist() == [0, 3, 4, 6]
    assert (step.meta.max_query_len, step.meta.max_seq_len) == (3, 18)
    assert step.sample_indices.tolist() == [2, 3]


def test_execute_returns_logits_only_for_sampling_chunks_in_order(runner):
    a, b, c = [5, 6, 7, 8], [9, 10], [30, 31, 32]
    # Alone, each in its own blocks...
    alone_a = runner.execute([ScheduledChunk(a, 0, [0], True)]).logits[0]
    alone_c = runner.execute([ScheduledChunk(c, 0, [1], True)]).logits[0]
    # ...then together with a chunk that does not sample in between.
    logits = runner.execute([ScheduledChunk(a, 0, [2], True), ScheduledChunk(b, 0, [3], False),
                             ScheduledChunk(c, 0, [4], True)]).logits
    assert logits.shape == (2, runner.vocab_size) and logits.dtype == torch.float32
    # A batch of 9 rows sums in other vector lanes than one of 4: the AVX2 build of the CPU kernels differs by
    # up to ~1.1e-5 here (the AVX-512 build by less).
    torch.testing.assert_close(logits[0], alone_a, atol=2e-5, rtol=0)
    torch.testing.assert_close(logits[1], alone_c, atol=2e-5, rtol=0)
    assert not torch.allclose(logits[0], logits[1])
    assert runner.last_forward_seconds > 0


def test_execute_with_nothing_sampling_or_nothing_scheduled(runner):
    assert runner.execute([ScheduledChunk([1, 2], 0, [0], False)]).logits.shape == (0, runner.vocab_size)
    assert runner.execute([]).logits.shape == (0, runner.vocab_size)


def test_new_keys_and_values_land_in_their_slots_only(runner):
    for k_cache, v_cache in runner.kv_caches:
        k_cache.zero_(), v_cache.zero_()
    runner.execute([ScheduledChunk([3, 4, 5], start_pos=14, block_table=[0, 6], sample=False)])
    for k_cache, v_cache in runner.kv_caches:
        for cache in (k_cache, v_cache):
            written = cache.abs().sum(dim=(2, 3)).nonzero().tolist()  # [[block, offset]]
            assert written == [[0, 14], [0, 15], [6, 0]]  # positions 14, 15, 16


def test_profiling_step_spans_the_token_budget_within_limits():
    chunks = profiling_chunks(num_tokens=1000, max_num_seqs=64, max_model_len=256, block_size=16)
    assert sum(len(c.token_ids) for c in chunks) == 1000
    assert len(chunks) == 64 and all(c.sample for c in chunks)
    blocks = [b for c in chunks for b in c.block_table]
    assert len(blocks) == len(set(blocks))
    long_budget = profiling_chunks(num_tokens=1000, max_num_seqs=2, max_model_len=256, block_size=16)
    assert len(long_budget) == 4 and max(len(c.token_ids) for c in long_budget) <= 256


def test_bfloat16_runs_end_to_end_close_to_float32(llama_dir, runner):
    config = EngineConfig(model=str(llama_dir), num_kv_blocks=40, max_model_len=256, dtype="bfloat16")
    bf16 = ModelRunner(config)
    assert bf16.dtype == torch.bfloat16
    assert all(k.dtype == torch.bfloat16 for k, _ in bf16.kv_caches)
    ids = [7, 99, 45, 3, 250, 17, 18, 400, 12, 5]
    chunks = [ScheduledChunk(ids[:6], 0, [1], False), ScheduledChunk(ids[6:], 6, [1], True)]
    ref = [runner.execute([c]).logits for c in chunks][-1][0]
    low = [bf16.execute([c]).logits for c in chunks][-1][0]
    assert low.dtype == torch.float32
    assert (low - ref).abs().max() < 0.1 * ref.abs().max()  # bf16 keeps ~3 significant digits
    assert int(low.argmax()) == int(ref.argmax())


def test_cuda_profiling_path_runs_a_forward_and_budgets_the_rest(runner, monkeypatch):
    # No GPU here: stand in for the torch.cuda memory queries; the profiling forward itself runs on the CPU.
    gib = 2**30
    fake = {"mem_get_info": (30 * gib, 80 * gib), "max_memory_allocated": 12 * gib,
            "memory_reserved": 49 * gib}
    for name, value in fake.items():
        monkeypatch.setattr(torch.cuda, name, lambda *_, v=value: v)
    for name in ("empty_cache", "reset_peak_memory_stats", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, lambda *_: None)
    layout = KVCacheLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    scratch_blocks = sum(len(c.block_table) for c in profiling_chunks(
        runner.config.max_num_batched_tokens, runner.config.max_num_seqs, runner.max_model_len, 16))
    peak = 12 * gib - scratch_blocks * layout.bytes_per_block  # the scratch cache is not activation memory
    expected = int(0.9 * 80 * gib) - peak - (80 * gib - 30 * gib - 49 * gib)
    assert runner._profile_cuda_free_bytes(layout) == expected


def test_the_attention_plan_is_built_once_per_step_for_every_layer(runner, monkeypatch):
    assert runner.model.settings.num_layers > 1
    built = []
    group_sequences = reference._group_sequences

    def counting(*args, **kwargs):  # every plan (torch's, or the cpu backend's prefill part) groups once
        built.append(1)
        return group_sequences(*args, **kwargs)

    monkeypatch.setattr(reference, "_group_sequences", counting)
    chunks = [ScheduledChunk(token_ids=[5, 6, 7], start_pos=0, block_table=[2], sample=True),
              ScheduledChunk(token_ids=[9], start_pos=20, block_table=[3, 4], sample=True)]
    runner.execute(chunks)
    assert len(built) == 1


def test_num_threads_is_applied_when_the_runner_is_built(llama_dir, monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    ModelRunner(EngineConfig(model=str(llama_dir), num_kv_blocks=40, max_model_len=256, num_threads=3))
    assert calls == [3]
    # None leaves torch's setting alone:
    ModelRunner(EngineConfig(model=str(llama_dir), num_kv_blocks=40, max_model_len=256))
    assert calls == [3]


def test_num_threads_below_one_is_refused(llama_dir):
    with pytest.raises(ValueError, match="num_threads"):
        EngineConfig(model=str(llama_dir), num_threads=0)
