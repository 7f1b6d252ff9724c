"""A failing step fails only the requests that fail alone; the others get the tokens of a clean run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conveyor.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from conveyor.engine.scheduled_chunk import RunnerOutput, ScheduledChunk
from conveyor.engine.tokenizer import Tokenizer
from tests.support.engine import drain
from tests.support.fake_runner import FailingRunner, FakeRunner, reference
from tests.support.poison_runner import PoisonRunner

VOCAB = 64
MARKER = 60  # first prompt token of the poisoned request; no other prompt starts with it
OVERFLOWING_TOP_K = 1180591620717411303424  # the operator's value: 2**70 overflows int64 in the sampler
Requests = dict[str, tuple[list[int], SamplingParams]]


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> Tokenizer:
    return Tokenizer(llama_dir)


class SpreadRunner(PoisonRunner):
    """Logits with a real spread, so seeded sampling depends on the noise; still a function of the history."""

    def execute(self, chunks: list[ScheduledChunk]) -> RunnerOutput:
        out = super().execute(chunks)
        peaks = out.logits  # [N, V]: 20 at next_token(history), 0 elsewhere
        noise = [torch.randn(VOCAB, generator=torch.Generator().manual_seed(int(peak)))
                 for peak in peaks.argmax(-1)]
        return RunnerOutput(peaks / 10 + 2 * torch.stack(noise) if noise else peaks, out.prompt_logprobs)


def make_engine(tokenizer: Tokenizer, runner: FakeRunner) -> LLMEngine:
    config = EngineConfig(model="unused", num_kv_blocks=runner.num_kv_blocks)
    return LLMEngine(config, runner=runner, tokenizer=tokenizer)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def seeded(max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True)


def twelve_requests() -> Requests:
    """As many as the operator's failed step held: greedy and seeded, of different lengths."""
    return {
        f"r{i}": ([5 + i] * (i % 4 + 1) + [7], greedy(6 + i) if i % 2 else seeded(6 + i, seed=i))
        for i in range(12)
    }


def add(engine: LLMEngine, requests: Requests) -> None:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)


def clean_run(tokenizer: Tokenizer, runner: FakeRunner, requests: Requests) -> dict[str, list[int]]:
    engine = make_engine(tokenizer, runner)
    add(engine, requests)
    done = drain(engine)
    assert engine.totals.failed_requests == 0
    return {rid: done[rid].token_ids for rid in requests}


def step_until_poison_fails(engine: LLMEngine, requests: Requests) -> dict[str, RequestOutput]:
    """Steps until a step fails the poison; checks the others got their token in that very step."""
    for _ in range(10):
        outputs = {o.request_id: o for o in engine.step()}
        if engine.last_failures:
            assert [f.request_ids for f in engine.last_failures] == [["poison"]]
            assert outputs["poison"].finish_reason == "abort"
            assert all(outputs[rid].num_new_tokens == 1 for rid in requests), "the others carry on"
            return outputs
    raise AssertionError("the poison never failed")


# --- a forward that fails for one request ------------------------------------------------------------------


def test_a_poisoned_forward_fails_only_its_request_and_the_others_match_a_clean_run(tokenizer) -> None:
    requests = twelve_requests()
    clean_runner = SpreadRunner(MARKER, num_kv_blocks=64, vocab_size=VOCAB)
    clean = clean_run(tokenizer, clean_runner, requests)
    assert clean_runner.calls == len(clean_runner.steps), "a step that does not fail runs one forward"

    runner = SpreadRunner(MARKER, fail_from=6, num_kv_blocks=64, vocab_size=VOCAB)  # fails at its 4th token
    engine = make_engine(tokenizer, runner)
    add(engine, requests)
    engine.add_request("poison", [MARKER, 9, 9], greedy(20))
    calls = runner.calls
    outputs = step_until_poison_fails(engine, requests)

    assert len(outputs["poison"].token_ids) == 3, "its streamed tokens stay; it fails where it failed"
    [failure] = engine.last_failures
    assert isinstance(failure.__cause__, RuntimeError) and str(failure.__cause__) == "poisoned forward"
    assert runner.calls - calls - 3 <= 1 + 2 * 4, "bisection: about 2 log2(13) retries, not 13"
    done = drain(engine)
    assert {rid: done[rid].token_ids for rid in requests} == clean
    assert all(done[rid].finish_reason == "length" for rid in requests)
    assert engine.totals.failed_requests == 1 and engine.totals.finished_requests == 12


def test_greedy_survivors_of_a_poisoned_prefill_match_the_reference(tokenizer) -> None:
    """The poison fails in its first step, next to other requests' prefills (the runner scribbles over
    every chunk's slots before raising: the survivors' retried chunks must write them again)."""
    requests = {f"g{i}": ([3 + i, 4, 5 + i] * (i + 1), greedy(5 + i)) for i in range(6)}
    runner = PoisonRunner(MARKER, num_kv_blocks=64, vocab_size=VOCAB)
    engine = make_engine(tokenizer, runner)
    engine.add_request("poison", [MARKER, 1, 2], greedy(4))
    add(engine, requests)
    outputs = step_until_poison_fails(engine, requests)
    assert outputs["poison"].token_ids == []
    done = drain(engine)
    for rid, (prompt, params) in requests.items():
        assert done[rid].token_ids == reference(prompt, params.max_tokens, VOCAB)


# --- a sampler that fails for one request: the operator's top_k --------------------------------------------


def test_the_operators_top_k_fails_only_its_request_when_it_gets_past_validation(tokenizer) -> None:
    """validate() refuses that top_k now; here it is set behind validation's back, as a bug could, to check
    the second line of defence with the very exception that failed the operator's 12 requests."""
    requests = twelve_requests()
    clean = clean_run(tokenizer, SpreadRunner(MARKER, num_kv_blocks=64, vocab_size=VOCAB), requests)

    engine = make_engine(tokenizer, SpreadRunner(MARKER, num_kv_blocks=64, vocab_size=VOCAB))
    add(engine, requests)
    engine.add_request("poison", [50, 9], seeded(20, seed=99))
    engine.step()
    engine.step()
    poison = engine.scheduler.get("poison")
    assert poison is not None
    poison.params.top_k = OVERFLOWING_TOP_K  # with top_p < 1 the sampler builds an int64 tensor of top_k
    step_until_poison_fails(engine, requests)

    [failure] = engine.last_failures
    assert isinstance(failure.__cause__, (OverflowError, RuntimeError, ValueError))
    assert "Overflow" in str(failure.__cause__)
    done = drain(engine)
    assert {rid: done[rid].token_ids for rid in requests} == clean, "seeded rows keep their noise"
    assert engine.totals.failed_requests == 1


def test_rows_that_fail_only_together_all_survive(tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nobody is to blame when every part succeeds alone: all keep their tokens."""
    requests = {f"g{i}": ([3 + i, 4], greedy(4)) for i in range(5)}
    engine = make_engine(tokenizer, FakeRunner(num_kv_blocks=32, vocab_size=VOCAB))
    sampler = engine.sampler
    monkeypatch.setattr(engine, "sampler", _failing_for_batches_over(3, sampler))
    add(engine, requests)
    done = drain(engine)
    for rid, (prompt, params) in requests.items():
        assert done[rid].token_ids == reference(prompt, params.max_tokens, VOCAB)
    assert engine.totals.failed_requests == 0


def _failing_for_batches_over(limit: int, sampler: Callable[..., object]) -> Callable[..., object]:
    def sample(logits: torch.Tensor, seqs: list, eos: frozenset[int]) -> object:
        if len(seqs) > limit:
            raise RuntimeError("too many rows")
        return sampler(logits, seqs, eos)

    return sample


# --- failures nobody in particular caused ------------------------------------------------------------------


def test_a_transient_failure_is_retried_and_fails_nobody(tokenizer) -> None:
    requests = {f"t{i}": ([7 + i] * 3, greedy(5)) for i in range(4)}
    engine = make_engine(tokenizer, FailingRunner(fail_on={2}, num_kv_blocks=32, vocab_size=VOCAB))
    add(engine, requests)
    done = drain(engine)
    for rid, (prompt, params) in requests.items():
        assert done[rid].token_ids == reference(prompt, params.max_tokens, VOCAB)
    assert engine.totals.failed_requests == 0 and not engine.last_failures


def test_a_broken_device_fails_every_request_then_the_engine_serves_again(tokenizer) -> None:
    runner = PoisonRunner(MARKER, num_kv_blocks=32, vocab_size=VOCAB)
    engine = make_engine(tokenizer, runner)
    for i in range(5):
        engine.add_request(f"b{i}", [5 + i, 6], greedy(4))
    runner.broken = True
    outputs = engine.step()
    assert runner.calls == 2 * 5 - 1, "each request is tried alone once, no more"
    assert sorted(o.request_id for o in outputs) == [f"b{i}" for i in range(5)]
    assert all(o.finish_reason == "abort" for o in outputs)
    assert sorted(rid for f in engine.last_failures for rid in f.request_ids) == [f"b{i}" for i in range(5)]
    assert engine.totals.failed_requests == 5 and not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == 32

    runner.broken = False
    engine.add_request("after", [9, 10], greedy(3))
    assert drain(engine)["after"].token_ids == reference([9, 10], 3, VOCAB)
    assert not engine.last_failures, "last_failures holds only the last step's"


def test_a_lone_request_that_fails_is_not_retried(tokenizer) -> None:
    runner = PoisonRunner(MARKER, num_kv_blocks=32, vocab_size=VOCAB)
    engine = make_engine(tokenizer, runner)
    engine.add_request("poison", [MARKER], greedy(3))
    [out] = engine.step()
    assert out.finish_reason == "abort" and runner.calls == 1


def test_logprobs_beyond_the_vocabulary_are_refused(tokenizer) -> None:
    """The sampler's top-n cannot exceed V, and that would fail after the seeded rows drew their noise."""
    engine = make_engine(tokenizer, FakeRunner(num_kv_blocks=32, vocab_size=VOCAB))
    with pytest.raises(ValueError, match=r"^logprobs"):
        engine.add_request("lp", [5], SamplingParams(logprobs=VOCAB + 1))
    engine.add_request("ok", [5], SamplingParams(max_tokens=2, logprobs=VOCAB))
    assert len(drain(engine)["ok"].logprobs or []) == 2


# --- the real model: retried forwards give the same tokens ------------------------------------------------


@pytest.fixture(scope="module")
def engine(llama_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=128, max_model_len=256))


def test_survivors_of_a_failed_real_forward_match_a_clean_run(engine: LLMEngine, monkeypatch) -> None:
    """The real runner: the failing attempt writes every chunk's K/V, then garbage over it, then raises."""
    requests = {f"m{i}": ([11 + i] * (2 + i) + [40, 41], greedy(6) if i % 2 else seeded(6, seed=i))
                for i in range(6)}
    add(engine, requests)
    clean = {rid: out.token_ids for rid, out in drain(engine).items()}

    execute = engine.runner.execute
    poisoned_block: list[int] = []

    def failing_execute(chunks: list[ScheduledChunk]) -> torch.Tensor:
        logits = execute(chunks)
        if any(c.block_table[0] in poisoned_block for c in chunks):
            _scribble(engine, chunks)
            raise RuntimeError("poisoned forward")
        return logits

    monkeypatch.setattr(engine.runner, "execute", failing_execute)
    add(engine, requests)
    engine.add_request("poison", [MARKER, 9, 9], greedy(10))
    engine.step()
    engine.step()
    poison = engine.scheduler.get("poison")
    assert poison is not None
    poisoned_block.append(poison.block_table[0])
    step_until_poison_fails(engine, requests)
    assert {rid: out.token_ids for rid, out in drain(engine).items()} == clean


def _scribble(engine: LLMEngine, chunks: list[ScheduledChunk]) -> None:
    block_size = engine.block_manager.block_size
    for chunk in chunks:
        for pos in range(chunk.start_pos, chunk.seq_len):
            block, offset = chunk.block_table[pos // block_size], pos % block_size
            for k_cache, v_cache in engine.runner.kv_caches:  # type: ignore[attr-defined]
                k_cache[block, offset] = 100.0
                v_cache[block, offset] = -100.0

