"""Speculation through LLMEngine over model doubles whose next token is a known function of what they read
back from their cache, so every output is checked against plain decoding computed by hand:

- a cycling double (mostly repeats the token `PERIOD` back, sometimes a hash): drafts are often right and
  sometimes wrong; any draft K/V left behind, a lost or shared block with the wrong content, changes later
  tokens;
- a Markov double (logits from the last token only, a real distribution): sampled outputs keep their
  distribution, seeded ones their exact tokens, logprobs their values.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from conveyor.engine.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.tokenizer import Tokenizer
from tests.support.engine import drain
from tests.support.fake_runner import FakeRunner, next_token

VOCAB = 64
PERIOD = 5


class CyclingRunner(FakeRunner):
    """Repeats the token PERIOD back, except where a hash of the history says otherwise (one in four)."""

    def next_token(self, history: list[int]) -> int:
        hashed = next_token(history, self.vocab_size)
        return hashed if hashed % 4 == 0 or len(history) < PERIOD else history[-PERIOD]


class MarkovRunner(FakeRunner):
    """Logits that depend on the last token only: a fixed random table (a real distribution)."""

    def __init__(self, **kwargs: int) -> None:
        super().__init__(**kwargs)
        self.table = torch.randn(self.vocab_size, self.vocab_size, generator=torch.Generator().manual_seed(7))

    def execute(self, chunks):  # type: ignore[no-untyped-def]
        out = super().execute(chunks)
        rows = [self.table[chunk.token_ids[i]] for chunk in chunks
                for i in range(len(chunk.token_ids) - chunk.num_logits_rows, len(chunk.token_ids))]
        return type(out)(torch.stack(rows) if rows else out.logits, out.prompt_logprobs)


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> Tokenizer:
    return Tokenizer(llama_dir)


def make_engine(tokenizer: Tokenizer, runner: FakeRunner, speculative: object, **config: object) -> LLMEngine:
    cfg = EngineConfig(model="unused", block_size=runner.block_size, num_kv_blocks=runner.num_kv_blocks,
                       speculative=speculative, **config)  # type: ignore[arg-type]
    return LLMEngine(cfg, runner=runner, tokenizer=tokenizer)


def plain_tokens(runner: FakeRunner, prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(runner.next_token(tokens))
    return tokens[len(prompt):]


def prompt(n: int, salt: int) -> list[int]:
    return [3 + (i * 11 + salt * 17 + i * i * salt) % (VOCAB - 3) for i in range(n)]


def greedy(max_tokens: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, RequestOutput]:
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    return drain(engine)


ALWAYS = {"dynamic": False, "num_tokens": 6}


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_outputs_equal_plain_decoding_through_chunked_prefill_preemption_and_prefix_hits(
    tokenizer: Tokenizer, method: str
) -> None:
    # 14 blocks of 8 for 6 requests of up to 110 tokens: some are preempted and recomputed; prompts come in
    # chunks of at most 12 tokens; two share a 40-token prefix (cache hits).
    runner = CyclingRunner(num_kv_blocks=14, block_size=8, max_model_len=128, vocab_size=VOCAB)
    engine = make_engine(tokenizer, runner, {"method": method, **ALWAYS}, max_num_batched_tokens=24,
                         long_prefill_token_threshold=12)
    shared = prompt(40, 9)
    prompts = {"a": prompt(30, 1), "b": prompt(45, 2), "c": shared + prompt(7, 3), "d": shared + prompt(3, 4),
               "e": prompt(12, 5), "f": prompt(60, 6)}
    done = run(engine, {rid: (ids, greedy(50)) for rid, ids in prompts.items()})
    assert {rid: out.token_ids for rid, out in done.items()} == {
        rid: plain_tokens(runner, ids, 50) for rid, ids in prompts.items()}
    drafted = sum(out.num_draft_tokens for out in done.values())
    accepted = sum(out.num_accepted_tokens for out in done.values())
    assert 0 < accepted < drafted  # drafts were right and wrong
    stats = engine.stats()
    assert stats["preemptions_total"] > 0 and engine.totals.prefix_cache_hits > 0
    assert stats["speculation"] == {"method": method, "drafted_tokens": drafted, "accepted_tokens": accepted,
                                    "acceptance_rate": accepted / drafted,
                                    "per_class": {"default": {"drafted_tokens": drafted,
                                                              "accepted_tokens": accepted}}}


def test_rejected_drafts_leave_nothing_in_the_prefix_cache(tokenizer: Tokenizer) -> None:
    runner = CyclingRunner(num_kv_blocks=64, block_size=8, max_model_len=256, vocab_size=VOCAB)
    engine = make_engine(tokenizer, runner, {"method": "ngram", **ALWAYS})
    first = run(engine, {"first": (prompt(10, 1), greedy(60))})["first"]
    assert first.num_accepted_tokens < first.num_draft_tokens
    # A request whose prompt is the first's whole sequence reads every block it left in the cache.
    again = prompt(10, 1) + first.token_ids
    second = run(engine, {"second": (again, greedy(20, speculate=False))})["second"]
    assert second.num_cached_tokens >= 64 and second.token_ids == plain_tokens(runner, again, 20)


def test_drafts_fit_the_step_budget_and_a_table_never_keeps_a_rejected_drafts_blocks(tokenizer: Tokenizer
                                                                                       ) -> None:
    runner = CyclingRunner(num_kv_blocks=64, block_size=8, max_model_len=256, vocab_size=VOCAB)
    engine = make_engine(tokenizer, runner, {"method": "suffix", **ALWAYS}, max_num_batched_tokens=10)
    for i in range(4):
        engine.add_request(f"r{i}", prompt(9, i), greedy(40))
    while engine.has_unfinished_requests():
        engine.step()
        assert sum(len(c.token_ids) for c in runner.steps[-1]) <= 10
        for seq in engine.scheduler.running:
            assert not seq.draft_token_ids
            assert len(seq.block_table) <= -(-seq.num_tokens // 8), "blocks kept past the tokens"
    assert engine.block_manager.num_free_blocks == 64
    assert any(c.num_draft_tokens for step in runner.steps for c in step)


def test_no_request_is_preempted_for_a_draft(tokenizer: Tokenizer) -> None:
    # One block of 16: the prompt and its 8 tokens fill it exactly; a draft past it would need a block.
    runner = CyclingRunner(num_kv_blocks=1, block_size=16, max_model_len=16, vocab_size=VOCAB)
    engine = make_engine(tokenizer, runner, {"method": "ngram", **ALWAYS})
    ids = prompt(8, 3)
    out = run(engine, {"r": (ids, greedy(8))})["r"]
    assert out.token_ids == plain_tokens(runner, ids, 8) and engine.stats()["preemptions_total"] == 0
    assert out.num_draft_tokens > 0


def test_a_request_can_turn_speculation_off(tokenizer: Tokenizer) -> None:
    runner = CyclingRunner(num_kv_blocks=64, block_size=8, max_model_len=256, vocab_size=VOCAB)
    engine = make_engine(tokenizer, runner, {"method": "ngram", **ALWAYS})
    requests = {"on": (prompt(20, 1), greedy(40)), "off": (prompt(20, 2), greedy(40, speculate=False))}
    done = run(engine, requests)
    assert done["on"].num_draft_tokens > 0 and done["off"].num_draft_tokens == 0
    assert done["off"].token_ids == plain_tokens(runner, prompt(20, 2), 40)


def test_max_tokens_and_stop_tokens_end_a_run_of_accepted_drafts_where_plain_decoding_ends(
    tokenizer: Tokenizer
) -> None:
    runner = CyclingRunner(num_kv_blocks=64, block_size=8, max_model_len=256, vocab_size=VOCAB)
    ids = prompt(20, 4)
    plain = plain_tokens(runner, ids, 60)
    stop = plain[37]
    cut = plain.index(stop) + 1
    engine = make_engine(tokenizer, runner, {"method": "ngram", **ALWAYS})
    done = run(engine, {"short": (ids, greedy(7)), "stopped": (ids, greedy(60, stop_token_ids=[stop]))})
    assert done["short"].token_ids == plain[:7] and done["short"].finish_reason == "length"
    assert done["stopped"].token_ids == plain[:cut] and done["stopped"].finish_reason == "stop"
    assert done["stopped"].num_accepted_tokens > 0


def markov_engine(tokenizer: Tokenizer, speculative: object, seed: int = 0) -> LLMEngine:
    runner = MarkovRunner(num_kv_blocks=2048, block_size=8, max_model_len=64, vocab_size=8)
    return make_engine(tokenizer, runner, speculative, max_num_seqs=256, seed=seed)


# The table's chain from token 3, then drafts from the prompt's own repeats ("3 5 7" recurs).
MARKOV_PROMPT = [3, 5, 7, 3, 5, 7, 3]


def test_seeded_sampling_gives_the_tokens_and_logprobs_plain_decoding_gives(tokenizer: Tokenizer) -> None:
    def outputs(speculative: object) -> dict[str, RequestOutput]:
        engine = markov_engine(tokenizer, speculative)
        return run(engine, {f"s{seed}": (MARKOV_PROMPT, SamplingParams(
            max_tokens=24, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True, logprobs=2,
            repetition_penalty=1.1, frequency_penalty=0.2)) for seed in range(24)})

    plain, spec = outputs(None), outputs({"method": "suffix", **ALWAYS})
    assert {r: o.token_ids for r, o in spec.items()} == {r: o.token_ids for r, o in plain.items()}
    assert {r: o.logprobs for r, o in spec.items()} == {r: o.logprobs for r, o in plain.items()}
    assert sum(o.num_accepted_tokens for o in spec.values()) > 0


def markov_distribution(table: torch.Tensor, start: int, steps: int) -> torch.Tensor:
    """The exact distribution of the token `steps` after `start` (temperature 1)."""
    probs = torch.nn.functional.one_hot(torch.tensor(start), table.shape[0]).double()
    transition = table.double().softmax(dim=-1)
    for _ in range(steps):
        probs = probs @ transition
    return probs


def test_sampled_outputs_keep_their_distribution(tokenizer: Tokenizer) -> None:
    """4,000 unseeded requests, speculating: the frequencies of the 2nd and 4th generated tokens are within
    0.04 (total variation) of the exact Markov distribution. The engine's generator is seeded, so the test is
    deterministic; the bound is ~4x the sampling error expected at this size (sqrt(V / N) / 2 = 0.022)."""
    engine = markov_engine(tokenizer, {"method": "ngram", **ALWAYS}, seed=11)
    params = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
    done = run(engine, {f"r{i}": (MARKOV_PROMPT, params) for i in range(4000)})
    drafted = sum(o.num_draft_tokens for o in done.values())
    accepted = sum(o.num_accepted_tokens for o in done.values())
    assert 0 < accepted < drafted  # drafts were both accepted and rejected
    table = engine.runner.table  # type: ignore[attr-defined]
    for position in (1, 3):
        counts = Counter(o.token_ids[position] for o in done.values())
        observed = torch.tensor([counts[t] / len(done) for t in range(8)], dtype=torch.float64)
        exact = markov_distribution(table, MARKOV_PROMPT[-1], position + 1)
        assert 0.5 * (observed - exact).abs().sum().item() < 0.04, (position, observed, exact)
    assert math.isclose(sum(counts.values()), 4000)
