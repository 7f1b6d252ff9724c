"""Prefix caching through LLMEngine over a FakeRunner: what the scheduler computes, exact block accounting.

The FakeRunner's next token hashes every token it reads back through the block table, so a shared block with
the wrong content, or one overwritten while shared, changes the output and fails the comparison with
`reference()`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.engine.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.sequence import Sequence
from conveyor.engine.tokenizer import Tokenizer
from tests.support.fake_runner import FakeRunner, reference

VOCAB = 64


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> Tokenizer:
    return Tokenizer(llama_dir)


def make_engine(
    tokenizer: Tokenizer, *, num_kv_blocks: int = 64, block_size: int = 16, max_model_len: int = 512, **config
) -> LLMEngine:
    runner = FakeRunner(num_kv_blocks, block_size, max_model_len, VOCAB)
    cfg = EngineConfig(model="unused", block_size=block_size, num_kv_blocks=num_kv_blocks, **config)
    return LLMEngine(cfg, runner=runner, tokenizer=tokenizer)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def tokens(n: int, salt: int = 0) -> list[int]:
    return [3 + (i * 7 + salt * 13 + i * i * salt) % (VOCAB - 3) for i in range(n)]


def drain(engine: LLMEngine, max_steps: int = 5_000) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished and out.finish_reason != "abort":
                done[out.request_id] = out.token_ids
    raise AssertionError("requests still unfinished")


def chunk_shapes(engine: LLMEngine) -> list[tuple[int, int]]:
    """(tokens, start position) of each chunk of the last step."""
    return [(len(c.token_ids), c.start_pos) for c in engine.runner.steps[-1]]


def test_cached_tokens_spend_no_budget_and_the_chunk_starts_after_them(tokenizer) -> None:
    engine = make_engine(tokenizer, max_num_batched_tokens=32)
    prefix = tokens(48, 1)  # three blocks
    engine.add_request("a", [*prefix, *tokens(8, 2)], greedy(2))
    drain(engine)
    engine.add_request("b", [*prefix, *tokens(8, 3)], greedy(2))
    engine.add_request("c", tokens(20, 4), greedy(2))
    outs = {o.request_id: o for o in engine.step()}
    assert chunk_shapes(engine) == [(8, 48), (20, 0)], "b computes 8 of 56 tokens; c fits in what is left"
    assert outs["b"].num_cached_tokens == 48 and outs["c"].num_cached_tokens == 0
    stats = engine.stats()
    assert stats["last_step"]["prefix_cache_hits"] == 48
    assert stats["last_step"]["prefix_cache_queries"] == 56 + 20
    assert stats["prefix_cache"]["hits_total"] == 48
    assert drain(engine) == {"b": reference([*prefix, *tokens(8, 3)], 2, VOCAB),
                             "c": reference(tokens(20, 4), 2, VOCAB)}


def test_with_caching_off_everything_is_computed(tokenizer) -> None:
    engine = make_engine(tokenizer, max_num_batched_tokens=32, enable_prefix_caching=False)
    prefix = tokens(48, 1)
    engine.add_request("a", [*prefix, *tokens(8, 2)], greedy(2))
    drain(engine)
    engine.add_request("b", [*prefix, *tokens(8, 3)], greedy(2))
    outs = engine.step()
    assert chunk_shapes(engine) == [(32, 0)] and outs == []
    assert engine.stats()["prefix_cache"] == {
        "enabled": False, "cached_blocks": 0, "hit_rate": None, "last_step_hit_rate": None,
        "queries_total": 0, "hits_total": 0, "evictions_total": 0,
    }
    assert drain(engine)["b"][:1] and engine.stats()["prefix_cache"]["hits_total"] == 0


def test_a_whole_prompt_in_the_cache_recomputes_only_its_last_block(tokenizer) -> None:
    engine = make_engine(tokenizer)
    prompt = tokens(32, 5)  # exactly two blocks
    engine.add_request("first", prompt, greedy(3))
    first = drain(engine)["first"]
    engine.add_request("again", prompt, greedy(3))
    out = engine.step()[0]
    assert chunk_shapes(engine) == [(16, 16)] and out.num_cached_tokens == 16
    engine.add_request("longer", [*prompt, 9], greedy(3))
    engine.step()
    assert chunk_shapes(engine)[-1] == (1, 32), "both blocks are cached now: one token left to compute"
    assert drain(engine) == {"again": first, "longer": reference([*prompt, 9], 3, VOCAB)}


def test_requests_that_share_a_prefix_in_one_step_compute_it_once(tokenizer) -> None:
    engine = make_engine(tokenizer)
    prefix = tokens(40, 6)  # two full blocks + 8 tokens
    engine.add_request("a", [*prefix, 1, 2, 3], greedy(4))
    engine.add_request("b", [*prefix, 4, 5], greedy(4))
    engine.add_request("c", tokens(10, 7), greedy(4))
    engine.step()
    assert chunk_shapes(engine) == [(43, 0)], "b would compute a's blocks again: it waits one step"
    engine.step()
    assert chunk_shapes(engine) == [(1, 43), (10, 32), (10, 0)], "b takes a's two full blocks"
    assert drain(engine) == {
        "a": reference([*prefix, 1, 2, 3], 4, VOCAB),
        "b": reference([*prefix, 4, 5], 4, VOCAB),
        "c": reference(tokens(10, 7), 4, VOCAB),
    }


def test_a_salt_keeps_a_prompt_from_hitting_another_salts_blocks(tokenizer) -> None:
    engine = make_engine(tokenizer)
    prompt = tokens(40, 8)  # two full blocks + 8 tokens
    engine.add_request("b", prompt, greedy(2), cache_salt="tenant:b")
    drain(engine)
    engine.add_request("a", prompt, greedy(2), cache_salt="tenant:a")
    engine.add_request("b-again", prompt, greedy(2), cache_salt="tenant:b")
    outs = {o.request_id: o for o in engine.step()}
    assert outs["a"].num_cached_tokens == 0 and outs["b-again"].num_cached_tokens == 32
    assert chunk_shapes(engine) == [(40, 0), (8, 32)], "a computes everything, in the same step as b-again"
    assert drain(engine) == {"a": reference(prompt, 2, VOCAB), "b-again": reference(prompt, 2, VOCAB)}


def test_same_step_requests_under_different_salts_do_not_wait_for_each_other(tokenizer) -> None:
    engine = make_engine(tokenizer)
    prompt = tokens(40, 9)
    engine.add_request("a", prompt, greedy(2), cache_salt="tenant:a")
    engine.add_request("b", prompt, greedy(2), cache_salt="tenant:b")
    engine.add_request("a-again", prompt, greedy(3), cache_salt="tenant:a")
    engine.step()
    assert chunk_shapes(engine) == [(40, 0), (40, 0)], "b is not a's prefix: it runs; a-again waits for a"
    outs = {o.request_id: o for o in engine.step()}
    assert chunk_shapes(engine)[-1] == (8, 32), "a-again takes a's two full blocks"
    assert outs["a-again"].num_cached_tokens == 32
    assert drain(engine) == {"a-again": reference(prompt, 3, VOCAB)}


def test_a_preempted_request_gets_its_cached_blocks_back(tokenizer) -> None:
    # 4 blocks of 8 tokens: a and b each start with 2; when a grows, b (latest) is preempted.
    engine = make_engine(tokenizer, num_kv_blocks=4, block_size=8, max_model_len=32)
    engine.add_request("a", tokens(16, 1), greedy(6))
    engine.add_request("b", tokens(16, 2), greedy(6))
    engine.step()
    engine.step()
    assert engine.stats()["last_step"]["preemptions"] == 1
    assert engine.block_manager.evictable_block_ids() == [2], "b's full prompt block stays cached"
    result = drain(engine)
    readmission = [c for step in engine.runner.steps for c in step if c.block_table[0] == 2 and c.start_pos]
    assert readmission[0].start_pos == 8, "b recomputes only what was not cached"
    assert engine.stats()["prefix_cache"]["hits_total"] == 8
    assert result == {"a": reference(tokens(16, 1), 6, VOCAB), "b": reference(tokens(16, 2), 6, VOCAB)}


def test_evictions_are_counted_per_step_and_in_total(tokenizer) -> None:
    engine = make_engine(tokenizer, num_kv_blocks=4, block_size=8, max_model_len=32)
    engine.add_request("a", tokens(24, 1), greedy(1))  # blocks 0-2 cached once done, 3 was never used
    drain(engine)
    engine.add_request("b", tokens(24, 2), greedy(1))  # needs 3: the free one, then evicts two of a's
    engine.step()
    assert engine.stats()["last_step"]["prefix_cache_evictions"] == 2
    drain(engine)
    assert engine.stats()["prefix_cache"]["evictions_total"] == 2


# --- randomised block accounting ---------------------------------------------------------------------

PREFIXES = [tokens(5, 11), tokens(8, 12), tokens(21, 13)]  # under a block, one block, several blocks
ADD = st.tuples(st.just("add"), st.integers(0, 2), st.integers(0, 12), st.integers(1, 24), st.integers(0, 9))
STEP = st.just(("step",))
OPS = st.one_of(ADD, STEP, STEP, st.tuples(st.just("abort"), st.integers(0, 50)), st.just(("preempt",)))
NUM_BLOCKS = 8  # room for two or three requests: steps preempt and evict


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, min_size=10, max_size=60), budget=st.sampled_from([8, 24, 64]))
def test_randomised_add_step_abort_preempt_keeps_every_block_accounted_for(
    tokenizer: Tokenizer, ops: list[tuple], budget: int
) -> None:
    engine = make_engine(tokenizer, num_kv_blocks=NUM_BLOCKS, block_size=8, max_model_len=64,
                         max_num_seqs=4, max_num_batched_tokens=budget)
    expected: dict[str, list[int]] = {}
    finished: dict[str, list[int]] = {}
    for i, op in enumerate(ops):
        if op[0] == "add":
            _, which, suffix_len, max_tokens, salt = op
            prompt = [*PREFIXES[which], *tokens(suffix_len, salt)]
            engine.add_request(f"r{i}", prompt, greedy(max_tokens))
            expected[f"r{i}"] = reference(prompt, max_tokens, VOCAB)
        elif op[0] == "abort" and expected:
            rid = sorted(expected)[op[1] % len(expected)]
            if engine.abort_request(rid):
                del expected[rid]
        elif op[0] == "preempt" and engine.scheduler.running:
            engine.scheduler._preempt(engine.scheduler.running[-1])  # what a step does when blocks run out
        else:
            finished |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
        assert_blocks_accounted_for(engine)
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
        assert_blocks_accounted_for(engine)
    assert engine.block_manager.num_used_blocks == 0
    assert sorted(engine.block_manager.free_block_ids()) == list(range(NUM_BLOCKS))
    assert {rid: finished[rid] for rid in expected} == expected


def assert_blocks_accounted_for(engine: LLMEngine) -> None:
    """Every block is free, evictable (cached, unheld) or held by exactly the sequences naming it."""
    bm, cache = engine.block_manager, engine.block_manager.prefix_cache
    assert cache is not None
    running = engine.scheduler.running
    holders = [0] * bm.num_blocks
    for seq in running:
        assert len(set(seq.block_table)) == len(seq.block_table), "a table names a block twice"
        assert len(seq.block_table) == -(-seq.num_computed_tokens // bm.block_size)
        for block in seq.block_table:
            holders[block] += 1
        assert_cached_blocks_hold_the_sequence_tokens(engine, seq)
    assert [bm.ref_count(b) for b in range(bm.num_blocks)] == holders
    free, evictable = bm.free_block_ids(), set(bm.evictable_block_ids())
    assert len(free) == len(set(free)), "a block is free twice"
    assert set(free) == {b for b in range(bm.num_blocks) if holders[b] == 0}
    assert all(cache.is_cached(b) == (b in evictable) for b in free), "free blocks are cached iff evictable"
    assert bm.num_used_blocks + len(free) == bm.num_blocks
    assert all(not s.block_table for q in engine.scheduler.waiting.values() for s in q)


def assert_cached_blocks_hold_the_sequence_tokens(engine: LLMEngine, seq: Sequence) -> None:
    """A running sequence's cached blocks are indexed under its own prefix hashes, and the (fake) KV cache
    holds its tokens in every computed slot."""
    bm, cache, runner = engine.block_manager, engine.block_manager.prefix_cache, engine.runner
    assert cache is not None and isinstance(runner, FakeRunner)
    for i, block in enumerate(seq.block_table):
        if cache.is_cached(block):
            assert i < seq.num_registered_blocks and cache.hash_of(block) == seq.block_hashes[i]
    computed = seq.token_slice(0, seq.num_computed_tokens)
    table = seq.block_table
    stored = [int(runner.cache[table[p // bm.block_size], p % bm.block_size]) for p in range(len(computed))]
    assert stored == computed, f"{seq.request_id}: the cache does not hold its tokens"
