"""Greedy generation with the Triton attention backend (interpreted on CPU) matches transformers."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from conveyor.engine.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.sampling_params import SamplingParams

# Prompt lengths straddle block boundaries; the small budget mixes prefill chunks with decodes.
REQUESTS = [("a", 5, 6), ("b", 17, 4), ("c", 40, 5), ("d", 1, 7)]


def prompt_of(length: int, vocab_size: int) -> list[int]:
    return [(7 * i + 3) % (vocab_size - 3) + 3 for i in range(length)]


def test_triton_backend_matches_transformers(llama_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    config = EngineConfig(model=str(llama_dir), num_kv_blocks=64, attention_backend="triton",
                          max_num_batched_tokens=24)
    engine = LLMEngine(config)
    assert engine.runner.attention_backend == "triton"
    expected = {}
    for rid, length, max_tokens in REQUESTS:
        prompt = prompt_of(length, engine.vocab_size)
        with torch.no_grad():
            mask = torch.ones(1, length, dtype=torch.long)
            out = model.generate(torch.tensor([prompt]), attention_mask=mask, max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0)
        expected[rid] = out[0, length:].tolist()
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    got = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                got[output.request_id] = output.token_ids
    assert got == expected
