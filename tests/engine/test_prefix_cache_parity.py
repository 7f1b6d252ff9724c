"""Greedy output with prefix caching on is token-for-token caching off and transformers' `generate`, for
staggered requests sharing prefixes shorter than a block, of exactly one block, of many blocks, and whole
prompts; with ample memory, under forced chunked prefill, and under a cache small enough to preempt and evict.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conveyor.engine.config import EngineConfig
from conveyor.engine.llm import LLM
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.sampling_params import SamplingParams
from tests.support.engine import run_staggered as staggered

Request = tuple[str, list[int], int]  # id, prompt, max_tokens


def make_requests(vocab_size: int) -> list[Request]:
    rng = random.Random(99)

    def draw(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    short, block, many, whole = draw(7), draw(16), draw(53), draw(48)  # block size 16
    return [
        ("short-a", short + draw(9), 12), ("short-b", short + draw(20), 5), ("short-whole", short, 8),
        ("many-a", many + draw(11), 20), ("block-a", block + draw(5), 9), ("many-b", many + draw(40), 7),
        ("block-b", block + draw(30), 14), ("block-whole", block, 6), ("many-c", many + draw(2), 17),
        ("whole-a", whole, 20), ("many-whole", many, 4), ("whole-b", whole, 11),
        ("whole-plus-1", [*whole, 5], 3), ("many-d", many + draw(27), 13),
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
        reference[rid] = out[0, len(prompt):].tolist()
    return reference


def run_staggered(llama_dir: Path, **config: object) -> tuple[dict[str, list[int]], LLMEngine]:
    """Adds 3 requests, then 1 more after every step, so prefixes are cached, shared and evicted mid-run."""
    engine = LLMEngine(EngineConfig(model=str(llama_dir), **config))  # type: ignore[arg-type]
    done = staggered(engine, make_requests(engine.vocab_size), first=3, then=1)
    assert engine.block_manager.num_used_blocks == 0
    return done, engine


SETTINGS = {
    "ample memory": dict(num_kv_blocks=256),
    "chunked prefill": dict(num_kv_blocks=256, max_num_batched_tokens=24, long_prefill_token_threshold=16),
    # 10 blocks x 16 = 160 token slots; the longest request needs 8 blocks.
    "tiny cache": dict(num_kv_blocks=10, max_model_len=160),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_prefix_caching_on_equals_off_equals_transformers(
    llama_dir: Path, hf_reference: dict[str, list[int]], setting: str
) -> None:
    config = SETTINGS[setting]
    on, engine = run_staggered(llama_dir, **config)
    off, baseline = run_staggered(llama_dir, enable_prefix_caching=False, **config)
    assert on == hf_reference
    assert off == hf_reference
    stats = engine.stats()["prefix_cache"]
    assert stats["hits_total"] > 0 and baseline.stats()["prefix_cache"]["hits_total"] == 0
    assert engine.totals.prefill_tokens < baseline.totals.prefill_tokens, "cached tokens are not computed"
    if setting == "tiny cache":
        assert engine.stats()["preemptions_total"] > 0
        assert stats["evictions_total"] > 0


def test_llm_generate_reuses_cached_blocks_only_under_the_same_salt(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=64, block_size=16)
    prompt = list(range(5, 45))  # two full blocks + 8 tokens
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    first = llm.generate([prompt], greedy, cache_salt="tenant:b")[0]
    assert first.num_cached_tokens == 0
    assert llm.generate([prompt], greedy, cache_salt="tenant:a")[0].num_cached_tokens == 0
    assert llm.generate([prompt], greedy)[0].num_cached_tokens == 0, "unsalted is its own partition"
    again = llm.generate([prompt], greedy, cache_salt="tenant:b")[0]
    assert again.num_cached_tokens == 32 and again.token_ids == first.token_ids


def test_llm_takes_the_switch_and_the_config_refuses_a_non_boolean(llama_dir: Path) -> None:
    assert LLM(str(llama_dir)).engine.block_manager.prefix_cache is not None, "on by default"
    assert LLM(str(llama_dir), enable_prefix_caching=False).engine.block_manager.prefix_cache is None
    with pytest.raises(ValueError, match="enable_prefix_caching must be True or False"):
        EngineConfig(model="m", enable_prefix_caching="false")  # type: ignore[arg-type]
