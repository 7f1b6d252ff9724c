"""Greedy generation of every family beyond Llama (sliding windows, Gemma, Phi-3, mixtures of experts) is
token-for-token transformers' `generate`, under continuous batching: staggered arrivals with chunked
prefill mixing decodes and prompt chunks, and a KV cache small enough to force preemption; with each CPU
attention path the engine may choose (`cpu`: the C++ decode kernel; `torch`: the reference)."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conveyor.engine.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from tests.engine.model_families import FAMILIES
from tests.support.engine import run_staggered

PROMPT_LENGTHS = [3, 70, 17, 41, 9, 88, 25, 56]
MAX_TOKENS = [14, 9, 21, 6, 17, 11, 25, 8]


Request = tuple[str, list[int], int]  # id, prompt ids, max_tokens


def make_requests(vocab_size: int) -> list[Request]:
    rng = random.Random(38)
    return [(f"req{i}", [rng.randrange(3, vocab_size) for _ in range(n)], m)
            for i, (n, m) in enumerate(zip(PROMPT_LENGTHS, MAX_TOKENS, strict=True))]


def prefix_requests(vocab_size: int) -> list[Request]:
    """Requests sharing prefixes longer than the window (56 and 37 tokens), and a whole repeated prompt."""
    rng = random.Random(39)

    def draw(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    long, mid = draw(56), draw(37)
    return [("long-a", long + draw(9), 12), ("mid-a", mid + draw(30), 10), ("long-b", long + draw(25), 9),
            ("long-whole", long, 7), ("mid-b", mid + draw(3), 15), ("long-c", long + draw(1), 11),
            ("mid-whole", mid, 6), ("long-whole-2", long, 13)]


@cache
def hf_reference(path: Path, requests: str = "plain") -> dict[str, list[int]]:
    """transformers' greedy generate per request (eager attention: the only one that soft-caps)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    model.generation_config.eos_token_id = None
    reference = {}
    make = prefix_requests if requests == "prefix" else make_requests
    for rid, prompt, max_tokens in make(model.config.vocab_size):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0)
        reference[rid] = out[0, len(prompt):].tolist()
    return reference


@pytest.fixture(params=list(FAMILIES), scope="module")
def family_dir(request: pytest.FixtureRequest, tiny_model_dir) -> Path:
    arch, kwargs = FAMILIES[request.param]
    return tiny_model_dir(arch, **kwargs)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_chunked_prefill_with_staggered_arrivals(family_dir: Path, backend: str) -> None:
    config = EngineConfig(model=str(family_dir), num_kv_blocks=128, max_num_batched_tokens=32,
                          long_prefill_token_threshold=24, attention_backend=backend)
    engine = LLMEngine(config)
    done = run_staggered(engine, make_requests(engine.vocab_size), first=3, then=1)
    assert done == hf_reference(family_dir)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_preemption_under_a_tiny_kv_cache(family_dir: Path, backend: str) -> None:
    # 13 blocks x 8 = 104 token slots for 8 requests of up to 99 tokens arriving at once: one is preempted
    # and recomputed (with a window on every layer too, though their blocks before it are released).
    config = EngineConfig(model=str(family_dir), num_kv_blocks=13, block_size=8, max_model_len=104,
                          attention_backend=backend)
    engine = LLMEngine(config)
    done = run_staggered(engine, make_requests(engine.vocab_size), first=8, then=0)
    assert engine.stats()["preemptions_total"] > 0
    assert done == hf_reference(family_dir)


@pytest.mark.parametrize("case", ["mistral-window", "gemma2"])
@pytest.mark.parametrize("num_kv_blocks", [128, 14])
def test_prefix_caching_stays_exact_with_windows(tiny_model_dir, case: str, num_kv_blocks: int) -> None:
    """Every layer windowed (blocks before the window released, cached ones evictable) and sliding layers
    beside global ones; with room to spare, and in a cache small enough to evict and preempt."""
    arch, kwargs = FAMILIES[case]
    path = tiny_model_dir(arch, **kwargs)
    engine = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=num_kv_blocks, max_model_len=128,
                                    max_num_batched_tokens=48, attention_backend="cpu"))
    done = run_staggered(engine, prefix_requests(engine.vocab_size), first=2, then=1)
    assert done == hf_reference(path, "prefix")
    stats = engine.stats()["prefix_cache"]
    assert isinstance(stats, dict) and stats["hits_total"] > 0


def test_an_moe_step_reports_tokens_per_expert(tiny_model_dir) -> None:
    arch, kwargs = FAMILIES["mixtral"]
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir(arch, **kwargs)), num_kv_blocks=32,
                                    max_model_len=512))
    run_staggered(engine, make_requests(engine.vocab_size)[:2], first=2, then=0)
    totals = engine.stats()["totals"]
    assert isinstance(totals, dict)
    experts = totals["expert_tokens"]
    # Every computed token goes to 2 of the 4 experts in each of the 2 MoE layers.
    computed = totals["prefill_tokens"] + totals["decode_tokens"]
    assert len(experts) == 4 and sum(experts) == computed * 2 * 2
    assert sum(1 for n in experts if n > 0) > 1, "a random router spreads tokens over several experts"
