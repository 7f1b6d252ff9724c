"""The runner's logits equal transformers' (eager attention, fp32) for every supported architecture."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conveyor.engine.config import EngineConfig
from conveyor.engine.model_runner import ModelRunner
from conveyor.engine.scheduled_chunk import ScheduledChunk
from tests.engine.model_families import FAMILIES

TOL = 1e-4
# The expert sums (and Qwen2-MoE's shared expert on top) add fp32 rounding in another order than
# transformers' loop: their logits (magnitudes ~10 here) agree to a few 1e-5 relative.
MOE_TOL = 2e-4
MOE_ARCHS = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
BLOCK_SIZE = 16
NUM_BLOCKS = 48
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
CASES = {
    "llama": ("LlamaForCausalLM", {}),
    "llama-tied": ("LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama3-rope": ("LlamaForCausalLM", {"rope_scaling": LLAMA3_ROPE}),
    "llama-biases": ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    "mistral": ("MistralForCausalLM", {}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {}),  # head_dim 32 != hidden / heads = 16, q/k norms
    **FAMILIES,
}


@pytest.fixture(params=["torch", "cpu"], scope="module")
def backend(request) -> str:
    """The CPU paths the engine may choose: eager PyTorch, and the C++ decode kernel with the fused ops."""
    return request.param


@pytest.fixture(params=list(CASES), scope="module")
def model_dir(request, tiny_model_dir) -> Path:
    arch, kwargs = CASES[request.param]
    return tiny_model_dir(arch, **kwargs)


def tol(path: Path) -> float:
    """tiny_model_dir names each folder after its architecture."""
    return MOE_TOL if path.name in MOE_ARCHS else TOL


@cache
def _hf_model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def hf_last_logits(path: Path, ids: list[int]) -> torch.Tensor:  # [V]
    return _hf_model(path)(torch.tensor([ids])).logits[0, -1].float()


def make_runner(path: Path, backend: str = "torch") -> ModelRunner:
    config = EngineConfig(model=str(path), num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_model_len=256,
                          dtype="float32", device="cpu", attention_backend=backend)
    return ModelRunner(config)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def shuffled_blocks(n: int, seed: int, exclude: list[int] = ()) -> list[int]:  # type: ignore[assignment]
    free = [b for b in range(NUM_BLOCKS) if b not in exclude]
    random.Random(seed).shuffle(free)
    return free[:n]


def run_in_chunks(runner: ModelRunner, ids: list[int], sizes: list[int], blocks: list[int]) -> torch.Tensor:
    """Feeds `ids` through the cache in chunks of `sizes`; returns the last chunk's logits [V]."""
    assert sum(sizes) == len(ids)
    start = 0
    for i, size in enumerate(sizes):
        last = i == len(sizes) - 1
        chunk = ScheduledChunk(ids[start:start + size], start, blocks, sample=last)
        logits = runner.execute([chunk]).logits
        assert logits.shape == (1 if last else 0, runner.vocab_size)
        start += size
    return logits[0]


def test_whole_prompt_in_one_chunk(model_dir, backend):
    runner = make_runner(model_dir, backend)
    ids = prompt(45, seed=1)
    logits = runner.execute([ScheduledChunk(ids, 0, [7, 3, 11], sample=True)]).logits
    assert logits.dtype == torch.float32
    assert logits.shape == (1, runner.vocab_size)
    torch.testing.assert_close(logits[0], hf_last_logits(model_dir, ids), atol=tol(model_dir), rtol=0)


def test_prompt_in_chunks_through_a_shuffled_block_table(model_dir, backend):
    runner = make_runner(model_dir, backend)
    ids = prompt(70, seed=2)
    logits = run_in_chunks(runner, ids, [5, 16, 1, 30, 17, 1], shuffled_blocks(5, seed=3))
    torch.testing.assert_close(logits, hf_last_logits(model_dir, ids), atol=tol(model_dir), rtol=0)


def test_two_sequences_mixing_prefill_chunks_and_decode(model_dir, backend):
    runner = make_runner(model_dir, backend)
    a, b = prompt(21, seed=4), prompt(40, seed=5)
    blocks_a = shuffled_blocks(2, seed=6)
    blocks_b = shuffled_blocks(3, seed=7, exclude=blocks_a)
    # Step 1: all of a (samples) + the first chunk of b (does not sample).
    step1 = runner.execute([ScheduledChunk(a, 0, blocks_a, True),
                            ScheduledChunk(b[:25], 0, blocks_b, False)]).logits
    assert step1.shape == (1, runner.vocab_size)
    torch.testing.assert_close(step1[0], hf_last_logits(model_dir, a), atol=tol(model_dir), rtol=0)
    # Step 2: the rest of b (samples), listed first, + one decode token of a.
    a_next = int(step1[0].argmax())
    step2 = runner.execute([ScheduledChunk(b[25:], 25, blocks_b, True),
                            ScheduledChunk([a_next], 21, blocks_a, True)]).logits
    assert step2.shape == (2, runner.vocab_size)
    torch.testing.assert_close(step2[0], hf_last_logits(model_dir, b), atol=tol(model_dir), rtol=0)
    torch.testing.assert_close(step2[1], hf_last_logits(model_dir, [*a, a_next]), atol=tol(model_dir), rtol=0)


@pytest.mark.parametrize("case", ["llama", "qwen3", "gemma2", "mixtral"])
def test_triton_backend_under_the_interpreter(tiny_model_dir, case):
    """gemma2: windows and soft-capping in the Triton kernel; mixtral: the fused Triton MoE kernel too."""
    arch, kwargs = CASES[case]
    path = tiny_model_dir(arch, **kwargs)
    runner = make_runner(path, backend="triton")
    assert runner.attention_backend == "triton"
    a, b = prompt(19, seed=8), prompt(9, seed=9)
    blocks_a, blocks_b = [5, 2], [9]
    runner.execute([ScheduledChunk(a[:12], 0, blocks_a, False)])
    logits = runner.execute([ScheduledChunk(a[12:], 12, blocks_a, True),
                             ScheduledChunk(b, 0, blocks_b, True)]).logits
    torch.testing.assert_close(logits[0], hf_last_logits(path, a), atol=tol(path), rtol=0)
    torch.testing.assert_close(logits[1], hf_last_logits(path, b), atol=tol(path), rtol=0)
