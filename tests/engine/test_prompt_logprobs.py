"""Prompt logprobs (SamplingParams.prompt_logprobs) over the tiny random Llama equal transformers' log-softmax
of the prompt: over chunked prefill, with the prompt already in the prefix cache, with max_tokens=0, through
preemption and through a failed step retried per request; ordinary requests in the same batch are unaffected.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conveyor.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from conveyor.engine.scheduled_chunk import ChunkPromptLogprobs, RunnerOutput, ScheduledChunk
from conveyor.engine.tokenizer import Tokenizer
from tests.support.engine import drain
from tests.support.fake_runner import FakeRunner

TOL = 2.5e-4  # the AVX2 build of the CPU kernels: up to 1.9e-4 (at -1.11) after a step retried per request
# Relative, for the deep tail: the CPU backend's fused ops (RMSNorm, RoPE, SwiGLU) differ from eager by up
# to ~1.1e-5 of the value there with the AVX-512 build (1.7e-4 at a logprob of -16.6), ~3.1e-5 with the AVX2
# build (4.3e-4 at -13.9, an AMD EPYC without AVX-512); the torch backend stays within 3e-5.
REL = 4e-5


@pytest.fixture(scope="module")
def hf_model(llama_dir: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def make_engine(llama_dir: Path, **config: object) -> LLMEngine:
    settings: dict[str, object] = {"num_kv_blocks": 64, "max_model_len": 256, "max_num_batched_tokens": 16}
    return LLMEngine(EngineConfig(model=str(llama_dir), **(settings | config)))  # type: ignore[arg-type]


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def scored(k: int | None, max_tokens: int = 3, **kwargs: object) -> SamplingParams:
    """Greedy, EOS ignored, with prompt logprobs top-k (None: an ordinary request)."""
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, prompt_logprobs=k, **kwargs)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, RequestOutput]:
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    return drain(engine)


def assert_matches_transformers(hf_model: torch.nn.Module, ids: list[int], out: RequestOutput, k: int
                                ) -> None:
    """Each prompt token's logprob given those before it, and the top-k at its position, as transformers'."""
    with torch.no_grad():
        reference = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)  # [L, V]
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(ids) and entries[0] is None
    for pos in range(1, len(ids)):
        entry, row = entries[pos], reference[pos - 1]  # row: the distribution given ids[:pos]
        assert entry is not None and ids[pos] in entry
        assert entry[ids[pos]] == pytest.approx(row[ids[pos]].item(), abs=TOL, rel=REL)
        top = list(entry)[:k]  # the top-k first, most likely first; the prompt token last if not among them
        assert len(entry) == k + (ids[pos] not in top)
        expected = row.topk(k).values.tolist()
        assert [entry[t] for t in top] == pytest.approx(expected, abs=TOL, rel=REL)
        assert [row[t].item() for t in top] == pytest.approx(expected, abs=TOL, rel=REL)


def test_a_prompt_prefilled_over_several_steps_matches_transformers(llama_dir: Path, hf_model) -> None:
    engine = make_engine(llama_dir)
    ids = prompt(70, seed=1)
    engine.add_request("p", ids, scored(5))
    prefill_steps = 0
    while not (outs := engine.step()):
        prefill_steps += 1
    assert prefill_steps >= 3  # a budget of 16 tokens: the prompt is chunked
    assert outs[0].prompt_logprobs is not None and len(outs[0].token_ids) == 1
    out = drain(engine)["p"]
    assert len(out.token_ids) == 3
    assert_matches_transformers(hf_model, ids, out, k=5)
    assert out.prompt_logprobs is outs[0].prompt_logprobs  # complete: shared, never changed again


def test_the_top_k_may_be_zero_or_the_whole_vocabulary(llama_dir: Path, hf_model) -> None:
    engine = make_engine(llama_dir, max_num_batched_tokens=64)
    ids = prompt(20, seed=2)
    outs = run(engine, {"none": (ids, scored(0)), "all": (ids, scored(engine.vocab_size))})
    assert all(len(entry) == 1 for entry in outs["none"].prompt_logprobs[1:])  # type: ignore[index]
    assert_matches_transformers(hf_model, ids, outs["none"], k=0)
    assert_matches_transformers(hf_model, ids, outs["all"], k=engine.vocab_size)


def test_a_prompt_already_in_the_prefix_cache_is_computed_and_scored_in_full(llama_dir: Path, hf_model
                                                                             ) -> None:
    engine = make_engine(llama_dir, enable_prefix_caching=True)
    ids = prompt(60, seed=3)
    first = run(engine, {"first": (ids, scored(None))})["first"]
    assert first.prompt_logprobs is None and first.num_cached_tokens == 0
    again = run(engine, {"again": (ids, scored(2))})["again"]
    assert again.num_cached_tokens == 0  # took no hit
    assert_matches_transformers(hf_model, ids, again, k=2)
    assert again.token_ids == first.token_ids
    # Its blocks were published all the same: a later ordinary request hits them.
    assert engine.reset_prefix_cache() > 0
    run(engine, {"scorer": (ids, scored(2))})
    reader = run(engine, {"reader": (ids, scored(None))})["reader"]
    assert reader.num_cached_tokens == 48


def test_max_tokens_zero_only_scores_the_prompt(llama_dir: Path, hf_model) -> None:
    engine = make_engine(llama_dir)
    ids = prompt(40, seed=4)
    out = run(engine, {"echo": (ids, SamplingParams(max_tokens=0, prompt_logprobs=1))})["echo"]
    assert out.finish_reason == "length" and out.token_ids == [] and out.text == ""
    assert out.logprobs is None and out.metrics.first_token_time is None
    assert_matches_transformers(hf_model, ids, out, k=1)
    one = run(engine, {"one": ([7], SamplingParams(max_tokens=0, prompt_logprobs=3))})["one"]
    assert one.finish_reason == "length" and one.prompt_logprobs == [None]


def test_ordinary_requests_in_the_batch_get_the_tokens_they_get_alone(llama_dir: Path, hf_model) -> None:
    engine = make_engine(llama_dir, max_num_batched_tokens=64, enable_prefix_caching=False)
    ordinary = {f"o{i}": (prompt(9 + 7 * i, seed=10 + i), scored(None, max_tokens=6)) for i in range(3)}
    alone = {rid: run(engine, {rid: req})[rid].token_ids for rid, req in ordinary.items()}
    ids = prompt(50, seed=5)
    mixed = run(engine, {"o0": ordinary["o0"], "p": (ids, scored(3, logprobs=2)), "o1": ordinary["o1"],
                         "echo": (ids, scored(4, max_tokens=0)), "o2": ordinary["o2"]})
    assert {rid: mixed[rid].token_ids for rid in ordinary} == alone
    assert all(mixed[rid].prompt_logprobs is None for rid in ordinary)
    assert_matches_transformers(hf_model, ids, mixed["p"], k=3)
    assert_matches_transformers(hf_model, ids, mixed["echo"], k=4)


def test_preempted_mid_prompt_it_scores_the_prompt_again_without_duplicates(llama_dir: Path, hf_model
                                                                            ) -> None:
    # 8 blocks of 16: the earlier request's decode takes the blocks of the later one while it prefills.
    engine = make_engine(llama_dir, num_kv_blocks=8, max_model_len=128, enable_prefix_caching=False)
    first, ids = prompt(30, seed=6), prompt(100, seed=7)
    engine.add_request("first", first, scored(None, max_tokens=90))
    engine.add_request("scored", ids, scored(3, max_tokens=2))
    partial_at_preemption = []
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        seq = engine.scheduler.get("scored")
        before = len(seq.prompt_logprobs) if seq is not None and seq.prompt_logprobs is not None else 0
        done |= {out.request_id: out for out in engine.step() if out.finished}
        if seq is not None and seq.metrics.num_preemptions > len(partial_at_preemption):
            partial_at_preemption.append(before)
    assert any(1 < n < len(ids) for n in partial_at_preemption), partial_at_preemption
    assert_matches_transformers(hf_model, ids, done["scored"], k=3)


def test_a_failed_step_retried_per_request_keeps_each_prompt_logprob_once(llama_dir: Path, hf_model,
                                                                          monkeypatch) -> None:
    engine = make_engine(llama_dir, max_num_batched_tokens=32)
    execute, failed = engine.runner.execute, []

    def fail_once_when_batched(chunks: list[ScheduledChunk]) -> RunnerOutput:
        if len(chunks) > 1 and not failed:
            failed.append(len(chunks))
            raise RuntimeError("injected")
        return execute(chunks)

    monkeypatch.setattr(engine.runner, "execute", fail_once_when_batched)
    a, b = prompt(45, seed=8), prompt(30, seed=9)
    outs = run(engine, {"a": (a, scored(2)), "b": (b, scored(2, max_tokens=0))})
    assert failed and not engine.last_failures
    assert_matches_transformers(hf_model, a, outs["a"], k=2)
    assert_matches_transformers(hf_model, b, outs["b"], k=2)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"max_tokens": 0}, r"^max_tokens must be an int in \[1, "),
        ({"prompt_logprobs": -1}, r"^prompt_logprobs must be None or an int in \[0, "),
        ({"prompt_logprobs": True}, r"^prompt_logprobs"),
        ({"prompt_logprobs": 1.0}, r"^prompt_logprobs"),
        ({"prompt_logprobs": 2, "max_tokens": 0, "min_tokens": 1}, r"^min_tokens"),
        ({"prompt_logprobs": 2, "max_tokens": -1}, r"^max_tokens must be an int in \[0, "),
    ],
)
def test_invalid_prompt_logprobs_requests_are_refused_naming_the_field(params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params)


def test_prompt_logprobs_beyond_the_vocabulary_are_refused(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    with pytest.raises(ValueError, match=r"^prompt_logprobs must be at most the vocabulary size \(512\)"):
        engine.add_request("big", [5, 6], SamplingParams(prompt_logprobs=engine.vocab_size + 1))
    assert not engine.has_unfinished_requests()


class ScoringRunner(FakeRunner):
    """A FakeRunner that also returns prompt logprobs: 0 for every target and for token 0."""

    def execute(self, chunks: list[ScheduledChunk]) -> RunnerOutput:
        return RunnerOutput(super().execute(chunks).logits, [_zero_logprobs(c) for c in chunks])


def _zero_logprobs(chunk: ScheduledChunk) -> ChunkPromptLogprobs | None:
    if chunk.prompt_logprobs is None:
        return None
    n, k = len(chunk.prompt_targets), chunk.prompt_logprobs
    return ChunkPromptLogprobs(torch.tensor(chunk.prompt_targets), torch.zeros(n), torch.zeros(n, k).long(),
                               torch.zeros(n, k))


def fake_engine(runner: FakeRunner, tokenizer: Tokenizer) -> LLMEngine:
    config = EngineConfig(model="unused", num_kv_blocks=runner.num_kv_blocks, max_num_batched_tokens=20)
    return LLMEngine(config, runner=runner, tokenizer=tokenizer)


def test_the_scheduler_names_each_chunks_targets_and_takes_no_cache_hit(llama_dir: Path) -> None:
    runner = ScoringRunner(num_kv_blocks=32, block_size=16, max_model_len=256, vocab_size=64)
    engine = fake_engine(runner, Tokenizer(llama_dir))
    ids = [3 + i % 60 for i in range(40)]
    run(engine, {"cached": (ids, scored(None, max_tokens=1))})
    runner.steps.clear()
    queries = engine.totals.prefix_cache_queries
    out = run(engine, {"echo": (ids, SamplingParams(max_tokens=0, prompt_logprobs=1))})["echo"]
    chunks = [step[0] for step in runner.steps]
    assert [(c.start_pos, len(c.token_ids), c.sample) for c in chunks] == [(0, 20, False), (20, 20, False)]
    assert [c.prompt_targets for c in chunks] == [ids[1:21], ids[21:]]
    assert all(c.prompt_logprobs == 1 for c in chunks)
    assert out.finish_reason == "length" and out.num_cached_tokens == 0
    assert out.prompt_logprobs == [None] + [{0: 0.0, t: 0.0} for t in ids[1:]]
    assert engine.totals.prefix_cache_queries == queries  # it looked nothing up


def test_a_runner_that_returns_no_prompt_logprobs_fails_that_request_alone(llama_dir: Path) -> None:
    engine = fake_engine(FakeRunner(num_kv_blocks=32, vocab_size=64), Tokenizer(llama_dir))
    engine.add_request("plain", [5, 6, 7], scored(None))
    engine.add_request("scored", [5, 6, 7, 8], scored(1))
    outs = drain(engine)
    assert outs["plain"].finish_reason == "length" and outs["scored"].finish_reason == "abort"
