"""Speculation on real model code: every family's tiny model generates transformers' greedy tokens with
drafts on (through chunked prefill and preemption), and SmolLM2-135M-Instruct, a real model, keeps its
tokens, stop strings, structured outputs, logprobs and seeded samples while accepting most drafts of an
answer that copies its input."""

from __future__ import annotations

from itertools import cycle
from pathlib import Path
from typing import Any

import pytest

from conveyor.engine.config import EngineConfig
from conveyor.engine.llm import LLM
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.structured_output.constraint import StructuredOutput
from tests.engine.model_families import FAMILIES
from tests.engine.test_model_families import hf_reference, make_requests
from tests.engine.test_real_model import engine_answers, hf_answers  # noqa: F401 (a fixture)
from tests.support.engine import run_staggered

ALWAYS = {"dynamic": False}  # draft whenever a proposer finds something: exactness, not speed, is tested
CASES = list(zip(("llama", *FAMILIES), cycle(("ngram", "suffix")), strict=False))


@pytest.mark.parametrize(("family", "method"), CASES)
def test_every_family_generates_transformers_tokens_with_drafts(tiny_model_dir, family: str, method: str
                                                                 ) -> None:
    arch, kwargs = FAMILIES.get(family, ("LlamaForCausalLM", {}))
    folder = tiny_model_dir(arch, **kwargs)
    engine = LLMEngine(EngineConfig(model=str(folder), num_kv_blocks=13, block_size=8, max_model_len=104,
                                    max_num_batched_tokens=32, long_prefill_token_threshold=24,
                                    speculative={"method": method, "min_ngram": 1, **ALWAYS}))
    done = run_staggered(engine, make_requests(engine.vocab_size), first=8, then=0)
    assert engine.stats()["preemptions_total"] > 0
    assert done == hf_reference(folder)
    spec = engine.stats()["speculation"]
    assert isinstance(spec, dict) and spec["drafted_tokens"] > 0


ORDER = "\n".join(f"Line {i + 1}: part PN-{48213 + 97 * i}-{'ABCDE'[i % 5]}, "
                  f"{['hex bolt', 'lock nut', 'flat washer', 'spur gear', 'coil spring'][i % 5]}, "
                  f"price ${(13 * i) % 90 + 4}.{(7 * i) % 100:02d}" for i in range(12))
QUOTING = [{"role": "user", "content": f"Here is an order:\n{ORDER}\n\nCopy the first five lines exactly."}]


@pytest.fixture(scope="module")
def plain(smollm2_dir: Path) -> LLM:
    return LLM(str(smollm2_dir), max_num_seqs=16)


@pytest.fixture(scope="module")
def speculating(smollm2_dir: Path) -> LLM:
    return LLM(str(smollm2_dir), max_num_seqs=16, speculative={"method": "suffix", **ALWAYS})


def answer(llm: LLM, params: SamplingParams, messages: list[dict[str, str]] = QUOTING) -> RequestOutput:
    return llm.chat([messages], params)[0]


@pytest.mark.xdist_group("smollm2")
def test_the_real_model_answers_as_transformers_does_with_drafts_through_preemption(
    smollm2_dir: Path, hf_answers: dict[str, list[int]]  # noqa: F811
) -> None:
    llm = LLM(str(smollm2_dir), num_kv_blocks=20, max_model_len=256, max_num_seqs=12,
              max_num_batched_tokens=32, long_prefill_token_threshold=16,
              speculative={"method": "ngram", **ALWAYS})
    assert engine_answers(llm) == hf_answers
    assert llm.engine.stats()["preemptions_total"] > 0


@pytest.mark.xdist_group("smollm2")
def test_an_answer_that_copies_its_input_accepts_most_drafts_and_keeps_every_token(plain: LLM,
                                                                                    speculating: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=120)
    expected, got = answer(plain, params), answer(speculating, params)
    assert got.token_ids == expected.token_ids and got.text == expected.text
    assert "PN-48213-A" in got.text
    assert got.num_accepted_tokens > 0.5 * len(got.token_ids), (got.num_accepted_tokens, got.num_draft_tokens)


@pytest.mark.xdist_group("smollm2")
def test_stop_strings_logprobs_and_seeded_samples_stay_exact(plain: LLM, speculating: LLM) -> None:
    reference = answer(plain, SamplingParams(temperature=0, max_tokens=120)).text
    stop = reference[reference.index("PN-48407"):][:8]  # inside the third line
    for params in (SamplingParams(temperature=0, max_tokens=120, stop=[stop]),
                   SamplingParams(temperature=0, max_tokens=40, logprobs=3),
                   SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=60)):
        expected, got = answer(plain, params), answer(speculating, params)
        assert (got.token_ids, got.text, got.finish_reason) == (
            expected.token_ids, expected.text, expected.finish_reason)
        assert got.num_accepted_tokens > 0
        if params.logprobs:
            assert got.logprobs is not None and expected.logprobs is not None
            for ours, theirs in zip(got.logprobs, expected.logprobs, strict=True):
                assert ours.keys() == theirs.keys()
                assert all(abs(ours[t] - theirs[t]) < 1e-4 for t in ours)
    stopped = answer(speculating, SamplingParams(temperature=0, max_tokens=120, stop=[stop]))
    assert stopped.finish_reason == "stop"


@pytest.mark.xdist_group("smollm2")
def test_a_structured_answer_keeps_its_tokens_when_drafts_meet_the_grammar(plain: LLM, speculating: LLM
                                                                           ) -> None:
    schema: dict[str, Any] = {"type": "object", "properties": {"parts": {
        "type": "array", "items": {"type": "string", "pattern": "^PN-[0-9]{5}-[A-E]$"}, "maxItems": 4}},
        "required": ["parts"]}
    params = SamplingParams(temperature=0, max_tokens=80, structured=StructuredOutput(json_schema=schema))
    messages = [{"role": "user", "content": f"Here is an order:\n{ORDER}\n\nList the part numbers as JSON."}]
    expected, got = answer(plain, params, messages), answer(speculating, params, messages)
    assert got.token_ids == expected.token_ids and got.text.startswith("{")
    assert got.num_draft_tokens > 0
