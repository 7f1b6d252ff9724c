"""Greedy generation through the engine is token-for-token transformers' `generate`, in three settings.

The first two run with each CPU path the engine may choose: `cpu` (the C++ decode kernel and fused
element-wise ops, what "auto" picks where they build) and `torch` (the gather path and eager ops it falls back
to); Triton has its own file.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conveyor.engine.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.scheduled_chunk import ScheduledChunk
from tests.support.engine import run_staggered as staggered

PROMPT_LENGTHS = [1, 2, 5, 15, 16, 17, 31, 33, 64, 100, 128, 150, 200, 257, 301, 320, 7, 45]
MAX_TOKENS = [4, 9, 17, 1, 12, 20, 6, 24, 3, 16, 11, 8, 19, 5, 14, 10, 22, 13]


def make_requests(vocab_size: int) -> list[tuple[str, list[int], int]]:
    rng = random.Random(1234)
    return [
        (f"req{i}", [rng.randrange(3, vocab_size) for _ in range(n)], m)
        for i, (n, m) in enumerate(zip(PROMPT_LENGTHS, MAX_TOKENS, strict=True))
    ]


@pytest.fixture(scope="module")
def hf_reference(llama_dir: Path) -> dict[str, list[int]]:
    """transformers' greedy generate per request, EOS stopping disabled (the engine runs with ignore_eos)."""
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    model.generation_config.eos_token_id = None
    reference = {}
    for rid, prompt, max_tokens in make_requests(model.config.vocab_size):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
            )
        reference[rid] = out[0, len(prompt) :].tolist()
        assert len(reference[rid]) == max_tokens
    return reference


def record_chunks(engine: LLMEngine) -> list[list[ScheduledChunk]]:
    steps: list[list[ScheduledChunk]] = []
    execute = engine.runner.execute

    def recording_execute(chunks: list[ScheduledChunk]) -> torch.Tensor:
        steps.append(list(chunks))
        return execute(chunks)

    engine.runner.execute = recording_execute  # type: ignore[method-assign]
    return steps


def run_staggered(engine: LLMEngine) -> dict[str, list[int]]:
    """Adds 6 requests, then 2 more after every step, so new prompts arrive mid-generation."""
    done = staggered(engine, make_requests(engine.vocab_size), first=6, then=2)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return done


CPU_BACKENDS = ["cpu", "torch"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_ample_kv_memory(llama_dir: Path, hf_reference: dict[str, list[int]], backend: str) -> None:
    engine = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=512, attention_backend=backend))
    assert engine.runner.attention_backend == backend
    assert run_staggered(engine) == hf_reference
    assert engine.stats()["preemptions_total"] == 0


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_chunked_prefill(llama_dir: Path, hf_reference: dict[str, list[int]], backend: str) -> None:
    config = EngineConfig(model=str(llama_dir), num_kv_blocks=512, max_num_batched_tokens=48,
                          long_prefill_token_threshold=40, attention_backend=backend)
    engine = LLMEngine(config)
    steps = record_chunks(engine)
    assert run_staggered(engine) == hf_reference
    assert all(sum(len(c.token_ids) for c in chunks) <= 48 for chunks in steps)
    partial_prefills = [c for chunks in steps for c in chunks if not c.sample]
    assert len(partial_prefills) > 10, "the budget should have split long prompts into chunks"
    mixed = [chunks for chunks in steps if any(len(c.token_ids) == 1 for c in chunks)
             and any(len(c.token_ids) > 1 for c in chunks)]
    assert mixed, "decodes and prefill chunks should share steps"


def test_preemption_under_a_tiny_kv_cache(llama_dir: Path, hf_reference: dict[str, list[int]]) -> None:
    # 24 blocks x 16 = 384 token slots for 18 requests of up to 344 tokens.
    config = EngineConfig(model=str(llama_dir), num_kv_blocks=24, max_model_len=384)
    engine = LLMEngine(config)
    result = run_staggered(engine)
    assert engine.stats()["preemptions_total"] > 0
    assert result == hf_reference
