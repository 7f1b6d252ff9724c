"""Sliding-window models release the KV blocks no later query reads (BlockManager.free_outside_window).

With window W, a query at p reads keys p - W < k <= p, so after c computed tokens nothing reads a position
before c - W + 1 and block i is released once (i + 1) * block_size <= c - W + 1. The block-level tests use
W = 5 and block_size 4 (block 0 goes at c = 8, block 1 at c = 12) and assert exact ids; the engine-level
ones run a runner double whose next token depends on the window only, read back through the block table.

A sequence holds at most conveyor.engine.block_manager.max_blocks_held blocks at once (the window's and one
chunk's): a new one takes only the cached prefix blocks its first query reads, so the engine, the cache's
size and the requests it accepts all follow that bound; a real windowed model runs a context far longer than
its cache.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest
import torch

from conveyor.engine.block_manager import RELEASED, BlockManager, max_blocks_held, max_chunk_tokens
from conveyor.engine.config import EngineConfig
from conveyor.engine.input_processor import InputProcessor
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.pooling import PoolingConfig
from conveyor.engine.pooling_params import PoolingParams
from conveyor.engine.sampler import Sampler
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.scheduled_chunk import RunnerOutput, ScheduledChunk
from conveyor.engine.sequence import Sequence
from conveyor.engine.tokenizer import Tokenizer
from tests.support.engine import make_seq
from tests.support.fake_runner import FakeRunner, next_token

BS = 4
W = 5
X = RELEASED
VOCAB = 64


def admit(bm: BlockManager, seq: Sequence) -> list[int]:
    """What the scheduler and engine do for a request computed in one step: hits, blocks, registration, then
    the early release; returns its cache hits."""
    hits = bm.cached_prefix(seq)
    bm.allocate(seq, seq.num_tokens - len(hits) * BS, hits)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq)
    bm.free_outside_window(seq)
    return hits


def compute(bm: BlockManager, seq: Sequence, num_computed_tokens: int) -> int:
    """A step that brought seq to num_computed_tokens (its table already covers them); returns the blocks
    released."""
    seq.num_computed_tokens = num_computed_tokens
    bm.cache_computed_blocks(seq)
    return bm.free_outside_window(seq)


# --- the block manager ---------------------------------------------------------------------------------


def test_blocks_are_released_exactly_when_they_leave_the_window() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, sliding_window=W)
    seq = make_seq("a", list(range(10, 26)))  # 16 tokens, 4 blocks
    bm.allocate(seq, 16)
    assert seq.block_table == [0, 1, 2, 3]
    # The query at 7 reads keys 3..7: position 3 is block 0's last.
    assert compute(bm, seq, 7) == 0 and seq.block_table == [0, 1, 2, 3]
    # The query at 8 reads 4..8: block 0 (0..3) is read no more.
    assert compute(bm, seq, 8) == 1 and seq.block_table == [X, 1, 2, 3]
    assert bm.ref_count(0) == 0 and bm.free_block_ids() == [4, 5, 6, 7, 0]
    # The query at 9 reads 5..9, and 11 reads 7..11: both still read block 1 (4..7).
    assert compute(bm, seq, 9) == 0 and compute(bm, seq, 11) == 0
    assert seq.block_table == [X, 1, 2, 3]
    # The query at 12 reads 8..12.
    assert compute(bm, seq, 12) == 1 and seq.block_table == [X, X, 2, 3]
    assert seq.num_released_blocks == 2
    assert (bm.num_used_blocks, bm.num_free_blocks) == (2, 6)
    assert bm.free_block_ids() == [4, 5, 6, 7, 0, 1]


def test_a_long_step_releases_several_blocks_the_deepest_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS, sliding_window=W)
    seq = make_seq("a", list(range(10, 27)))  # 17 tokens, 5 blocks
    bm.allocate(seq, 17)
    assert compute(bm, seq, 17) == 3  # (17 - 5 + 1) // 4: the query at 17 reads 13..17
    assert seq.block_table == [X, X, X, 3, 4]
    assert bm.free_block_ids() == [5, 2, 1, 0]


def test_the_table_keeps_its_length_and_grows_at_its_logical_end() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS, sliding_window=W)
    seq = make_seq("a", list(range(10, 18)))
    bm.allocate(seq, 8)
    compute(bm, seq, 8)
    assert seq.block_table == [X, 1]
    assert bm.num_new_blocks(seq, 1) == 1  # position 8 is in logical block 2
    bm.append_slots(seq, 1)
    assert seq.block_table == [X, 1, 2]
    assert bm.free_block_ids() == [3, 0]


def test_the_final_free_releases_each_held_block_once_and_leaks_none() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, sliding_window=W)
    a, b = make_seq("a", list(range(10, 26))), make_seq("b", list(range(30, 35)))
    bm.allocate(a, 16)
    bm.allocate(b, 5)
    compute(bm, a, 12)
    compute(bm, b, 5)  # (5 - 5 + 1) // 4 = 0: b keeps both blocks
    assert (a.block_table, b.block_table) == ([X, X, 2, 3], [4, 5])
    bm.free(a)
    assert a.block_table == [] and a.num_released_blocks == 0
    assert bm.free_block_ids() == [6, 7, 1, 0, 3, 2]
    bm.free(b)
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0
    assert all(bm.ref_count(i) == 0 for i in range(8))


def test_a_released_cached_block_is_revived_by_a_hit_and_released_again() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True, sliding_window=W)
    prefix = list(range(10, 18))  # two full blocks
    a, b = make_seq("a", [*prefix, 1]), make_seq("b", [*prefix[:4], 3, 4, 5, 6, 7])
    assert admit(bm, a) == []
    assert a.block_table == [X, 1, 2], "at 9 tokens: the query at 9 reads 5..9"
    assert bm.evictable_block_ids() == [0]
    # b shares block 0 only: its first query (at 4) reads 0..4, so the hit revives block 0; b lets go of it
    # again at 9 tokens.
    assert admit(bm, b) == [0]
    assert b.block_table == [X, 3, 4]
    assert [bm.ref_count(i) for i in range(5)] == [0, 1, 1, 1, 1]
    assert bm.evictable_block_ids() == [0] and bm.num_used_blocks == 4
    bm.free(a)
    assert bm.cached_prefix(make_seq("c", [*prefix, 7])) == [X, 1]
    assert bm.cached_prefix(make_seq("d", [*prefix[:4], 7])) == [0]


def test_a_shared_block_released_by_one_holder_stays_held_by_the_other() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True, sliding_window=W)
    prefix = list(range(10, 18))
    a = make_seq("a", [*prefix, 1, 2, 3])  # 11 tokens: block 0 released at once
    b = make_seq("b", [*prefix[:4], 4, 5, 6, 7, 8])  # shares block 0, whose keys its first query reads
    hits_a = bm.cached_prefix(a)
    bm.allocate(a, 11, hits_a)
    a.num_computed_tokens = 11
    bm.cache_computed_blocks(a)  # registered, not yet released
    assert admit(bm, b) == [0]  # b releases its hold on block 0 at 9 tokens
    assert bm.ref_count(0) == 1, "a still holds block 0"
    assert bm.free_outside_window(a) == 1
    assert bm.ref_count(0) == 0 and bm.evictable_block_ids() == [0]
    assert bm.cached_prefix(make_seq("c", [*prefix[:4], 9])) == [0], "still a hit"


def test_a_released_cached_block_is_evictable_and_found_by_a_new_sequence() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS, enable_prefix_caching=True, sliding_window=W)
    a = make_seq("a", list(range(10, 23)))  # 3 full blocks + 1 token
    admit(bm, a)
    assert a.block_table == [X, X, 2, 3]  # (13 - 5 + 1) // 4 = 2
    assert bm.evictable_block_ids() == [1, 0] and bm.num_used_blocks == 2
    c = make_seq("c", [*range(10, 18), 99])
    hits = bm.cached_prefix(c)
    assert hits == [X, 1], "the query at 8 reads 4..8: block 0 is not taken"
    bm.allocate(c, 1, hits)
    assert c.block_table == [X, 1, 4] and c.num_released_blocks == 1
    assert bm.evictable_block_ids() == [0] and [bm.ref_count(i) for i in range(5)] == [0, 1, 1, 1, 1]


def test_preemption_after_a_release_frees_once_and_readmission_takes_the_cached_blocks_back() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS, enable_prefix_caching=True, sliding_window=W)
    seq = make_seq("a", list(range(10, 23)))
    admit(bm, seq)
    assert seq.block_table == [X, X, 2, 3]
    bm.free(seq)  # what Scheduler._preempt does, then it zeroes num_computed_tokens
    seq.num_computed_tokens = 0
    assert seq.num_released_blocks == 0 and seq.num_registered_blocks == 0
    assert bm.free_block_ids() == [4, 5, 3, 1, 0, 2] and bm.num_used_blocks == 0
    hits = bm.cached_prefix(seq)
    assert hits == [X, X, 2], "the query at 12 reads 8..12"
    bm.allocate(seq, 1, hits)
    assert seq.block_table == [X, X, 2, 4] and seq.num_released_blocks == 2
    seq.num_computed_tokens = 12
    assert compute(bm, seq, 13) == 0 and seq.block_table == [X, X, 2, 4]
    bm.free(seq)
    assert bm.num_used_blocks == 0 and all(bm.ref_count(i) == 0 for i in range(6))


def test_preemption_without_prefix_caching_starts_from_a_full_table() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS, sliding_window=W)
    seq = make_seq("a", list(range(10, 23)))
    admit(bm, seq)
    bm.free(seq)
    seq.num_computed_tokens = 0
    assert bm.free_block_ids() == [1, 0, 3, 2]
    bm.allocate(seq, 8)
    assert seq.block_table == [1, 0] and seq.num_released_blocks == 0


def test_a_block_is_released_only_once_registered_in_the_prefix_cache() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=True, sliding_window=W)
    seq = make_seq("a", list(range(10, 18)))
    bm.allocate(seq, 8)
    seq.num_computed_tokens = 8
    with pytest.raises(AssertionError, match="before cache_computed_blocks registered them"):
        bm.free_outside_window(seq)
    assert seq.block_table == [0, 1] and bm.num_used_blocks == 2


# --- a new sequence's cached prefix: only the window's blocks are taken ------------------------------------

W9 = 9  # with BS = 4, the query at 4h reads 4h - 8 .. 4h: a prefix of h blocks needs blocks h - 2 and h - 1


def test_a_long_cached_prefix_is_taken_from_the_window_of_its_first_query_on() -> None:
    bm = BlockManager(num_blocks=12, block_size=BS, enable_prefix_caching=True, sliding_window=W9)
    tokens = list(range(10, 34))  # six full blocks
    a = make_seq("a", [*tokens, 1])
    admit(bm, a)
    assert a.block_table == [X, X, X, X, 4, 5, 6]  # (25 - 9 + 1) // 4 = 4 released
    bm.free(a)
    assert bm.evictable_block_ids() == [3, 2, 1, 0, 5, 4]
    b = make_seq("b", [*tokens, 2, 3])
    hits = bm.cached_prefix(b)
    assert hits == [X, X, X, X, 4, 5], "the query at 24 reads 16..24: blocks 4 and 5"
    assert bm.can_allocate(2, hits)
    bm.allocate(b, 2, hits)
    assert b.block_table == [X, X, X, X, 4, 5, 7]
    assert (b.num_released_blocks, b.num_registered_blocks) == (4, 6)
    assert [bm.ref_count(i) for i in range(8)] == [0, 0, 0, 0, 1, 1, 0, 1]
    assert bm.evictable_block_ids() == [3, 2, 1, 0], "the skipped hits stay cached, and evictable"
    assert compute(bm, b, 26) == 0  # nothing new to register (insert would fail on a cached block) or release
    assert b.block_table == [X, X, X, X, 4, 5, 7]
    bm.free(b)
    assert bm.num_used_blocks == 0 and all(bm.ref_count(i) == 0 for i in range(12))
    free = bm.free_block_ids()
    assert sorted(free) == list(range(12)), "every block once: none leaked, none freed twice"


def test_registration_continues_after_the_skipped_hits() -> None:
    bm = BlockManager(num_blocks=12, block_size=BS, enable_prefix_caching=True, sliding_window=W9)
    tokens = list(range(10, 26))  # four full blocks
    admit(bm, make_seq("a", [*tokens, 1]))
    b = make_seq("b", [*tokens, *range(40, 50)])  # 26 tokens: blocks 4 and 5 are b's own
    assert admit(bm, b) == [X, X, 2, 3]
    assert b.num_registered_blocks == 6 and b.block_table[:6] == [X, X, X, X, 5, 6]
    cache = bm.prefix_cache
    assert cache is not None and [cache.hash_of(i) for i in (5, 6)] == b.block_hashes[4:6]
    assert bm.cached_prefix(make_seq("c", [*tokens, *range(40, 50), 7])) == [X, X, X, X, 5, 6]


def test_a_prefix_whose_head_was_evicted_is_still_a_hit() -> None:
    bm = BlockManager(num_blocks=7, block_size=BS, enable_prefix_caching=True, sliding_window=W9)
    tokens = list(range(10, 34))
    a = make_seq("a", [*tokens, 1])
    admit(bm, a)
    bm.free(a)
    other = make_seq("x", list(range(50, 66)))
    bm.allocate(other, 16)  # takes free block 6, then evicts 3, 2 and 1 (the least recently released)
    assert other.block_table == [6, 3, 2, 1] and bm.evictable_block_ids() == [0, 5, 4]
    b = make_seq("b", [*tokens, 2, 3])
    hits = bm.cached_prefix(b)
    assert hits == [X, X, X, X, 4, 5]
    # 3 blocks are free (all evictable): blocks 4 and 5 and one new block, none of the 6 the hits span.
    assert bm.num_free_blocks == 3 and bm.can_allocate(2, hits) and not bm.can_allocate(5, hits)
    bm.allocate(b, 2, hits)
    assert b.block_table == [X, X, X, X, 4, 5, 0] and bm.num_free_blocks == 0


def test_a_block_missing_in_the_window_shortens_the_hit() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS, enable_prefix_caching=True, sliding_window=W9)
    tokens = list(range(10, 30))  # five full blocks
    a = make_seq("a", [*tokens, 1])
    admit(bm, a)
    bm.free(a)
    assert bm.evictable_block_ids() == [2, 1, 0, 4, 3] and bm.free_block_ids()[0] == 5
    # Blocks 0..3 held by hits while one more block is taken: block 4 is evicted.
    y = make_seq("y", [*tokens[:16], 77])
    z = make_seq("z", [*tokens[:8], 55])
    assert admit(bm, y) == [X, X, 2, 3] and admit(bm, z) == [0, 1]
    assert z.block_table == [0, 1, 4] and bm.prefix_cache is not None
    assert bm.prefix_cache.hash_of(4) is None, "block 4 was evicted for z"
    bm.free(y)
    bm.free(z)
    # Five blocks would need blocks 3 and 4; four need 2 and 3, still cached.
    assert bm.cached_prefix(make_seq("q", [*tokens, 88])) == [X, X, 2, 3]


def test_a_one_token_window_needs_no_block_but_hits_only_what_was_computed() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS, enable_prefix_caching=True, sliding_window=1)
    tokens = list(range(10, 18))
    assert bm.cached_prefix(make_seq("a", [*tokens, 1])) == [], "an empty cache gives no hits"
    admit(bm, make_seq("a", [*tokens, 1]))
    b = make_seq("b", [*tokens, 2])
    hits = bm.cached_prefix(b)
    assert hits == [X, X], "the query at 8 reads position 8 alone"
    bm.allocate(b, 1, hits)
    assert b.block_table == [X, X, 3] and b.num_released_blocks == 2


def test_without_a_window_every_hit_is_taken_from_block_0() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    tokens = list(range(10, 26))
    admit(bm, make_seq("a", [*tokens, 1]))
    b = make_seq("b", [*tokens, 2])
    assert admit(bm, b) == [0, 1, 2, 3]
    assert b.block_table == [0, 1, 2, 3, 5] and b.num_released_blocks == 0


def test_without_a_window_nothing_is_released() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq("a", list(range(10, 26)))
    bm.allocate(seq, 16)
    assert compute(bm, seq, 16) == 0
    assert seq.block_table == [0, 1, 2, 3] and bm.num_used_blocks == 4


@pytest.mark.parametrize("window", [0, -4])
def test_the_window_is_at_least_one_token(window: int) -> None:
    with pytest.raises(ValueError, match="sliding_window must be None or >= 1"):
        BlockManager(num_blocks=8, block_size=BS, sliding_window=window)


def test_a_window_of_one_releases_every_full_block() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS, sliding_window=1)
    seq = make_seq("a", list(range(10, 18)))
    bm.allocate(seq, 8)
    assert compute(bm, seq, 8) == 2 and seq.block_table == [X, X]  # the query at 8 reads 8 alone
    bm.free(seq)
    assert bm.num_free_blocks == 4


# --- the engine ----------------------------------------------------------------------------------------


class WindowRunner(FakeRunner):
    """A FakeRunner for a model whose every layer attends within `window`: the next token depends on the
    last `window` tokens only, read back through the block table, and reading or writing a released block
    fails the step."""

    def __init__(self, window: int, **kwargs: int) -> None:
        super().__init__(**kwargs)
        self.kv_sliding_window = window
        self.max_blocks_in_a_table = 0  # the most blocks any chunk's table held

    def execute(self, chunks: list[ScheduledChunk]) -> RunnerOutput:
        self.steps.append(chunks)
        rows = []
        for chunk in chunks:
            held = [b for b in chunk.block_table if b != RELEASED]
            assert len(chunk.block_table) == -(-chunk.seq_len // self.block_size), chunk.block_table
            assert len(set(held)) == len(held), chunk.block_table
            self.max_blocks_in_a_table = max(self.max_blocks_in_a_table, len(held))
            for i, token in enumerate(chunk.token_ids):
                self._write(chunk.block_table, chunk.start_pos + i, token)
            if chunk.sample:  # the query at seq_len - 1 reads keys seq_len - window .. seq_len - 1
                first = max(0, chunk.seq_len - self.kv_sliding_window)
                history = [self._read(chunk.block_table, p) for p in range(first, chunk.seq_len)]
                row = torch.zeros(self.vocab_size)
                row[next_token(history, self.vocab_size)] = 20.0
                rows.append(row)
        logits = torch.stack(rows) if rows else torch.zeros(0, self.vocab_size)
        return RunnerOutput(logits, [None] * len(chunks))

    def _block(self, table: list[int], pos: int) -> int:
        block = table[pos // self.block_size]
        assert block != RELEASED, f"position {pos} is in a released block: {table}"
        return block

    def _write(self, table: list[int], pos: int, token: int) -> None:
        self.cache[self._block(table, pos), pos % self.block_size] = token

    def _read(self, table: list[int], pos: int) -> int:
        return int(self.cache[self._block(table, pos), pos % self.block_size])


def windowed_reference(prompt: list[int], max_tokens: int, window: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens[-window:], VOCAB))
    return tokens[len(prompt) :]


def prompt(n: int, salt: int = 0) -> list[int]:
    return [3 + (i * 7 + salt) % (VOCAB - 3) for i in range(n)]


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> Tokenizer:
    return Tokenizer(llama_dir)


def make_engine(tokenizer: Tokenizer, runner: FakeRunner, *, max_num_batched_tokens: int = 2048,
                long_prefill_token_threshold: int = 512) -> LLMEngine:
    cfg = EngineConfig(model="unused", block_size=runner.block_size, num_kv_blocks=runner.num_kv_blocks,
                       max_num_batched_tokens=max_num_batched_tokens,
                       long_prefill_token_threshold=long_prefill_token_threshold)
    return LLMEngine(cfg, runner=runner, tokenizer=tokenizer)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], int]], on_step: Callable[[], None]
        ) -> dict[str, list[int]]:
    for rid, (tokens, max_tokens) in requests.items():
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(rid, tokens, params)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
        on_step()
    return outputs


def test_a_long_generation_holds_only_the_windows_blocks(tokenizer: Tokenizer) -> None:
    runner = WindowRunner(window=12, num_kv_blocks=32, block_size=8, max_model_len=128, vocab_size=VOCAB)
    engine = make_engine(tokenizer, runner)
    used: list[int] = []
    outputs = run(engine, {"a": (prompt(20), 100)}, lambda: used.append(engine.block_manager.num_used_blocks))
    assert outputs == {"a": windowed_reference(prompt(20), 100, 12)}
    # After a step at c tokens, blocks (c - 11) // 8 .. ceil(c / 8) - 1 are held: at most 3, the blocks that
    # 12 positions can touch (15 without the release); so does a step's table, positions c - 11 .. c.
    assert max(used[:-1]) == 3 and used[-1] == 0
    assert runner.max_blocks_in_a_table == 3
    assert engine.block_manager.num_free_blocks == 32


def test_windowed_requests_share_a_prefix_and_survive_preemption_after_a_release(
        tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = WindowRunner(window=12, num_kv_blocks=10, block_size=8, max_model_len=128, vocab_size=VOCAB)
    engine = make_engine(tokenizer, runner, max_num_batched_tokens=16, long_prefill_token_threshold=8)
    released_at_preemption: list[int] = []
    preempt = engine.scheduler._preempt

    def recording_preempt(seq: Sequence) -> None:
        released_at_preemption.append(seq.num_released_blocks)
        preempt(seq)

    monkeypatch.setattr(engine.scheduler, "_preempt", recording_preempt)
    shared = prompt(16)
    requests = {f"r{i}": ([*shared, *prompt(8 + 4 * i, i)], 40) for i in range(4)}
    outputs = run(engine, requests, lambda: None)
    assert outputs == {rid: windowed_reference(p, n, 12) for rid, (p, n) in requests.items()}
    # Each victim had released blocks; readmitted, it takes back only its window's cached blocks.
    assert released_at_preemption and all(n >= 1 for n in released_at_preemption), released_at_preemption
    assert engine.totals.prefix_cache_hits > 0
    assert engine.block_manager.num_used_blocks == 0


def test_a_runner_without_a_window_keeps_every_block(tokenizer: Tokenizer) -> None:
    runner = FakeRunner(num_kv_blocks=32, block_size=8, max_model_len=128, vocab_size=VOCAB)
    engine = make_engine(tokenizer, runner)
    assert engine.block_manager.sliding_window is None
    used: list[int] = []
    run(engine, {"a": (prompt(20), 40)}, lambda: used.append(engine.block_manager.num_used_blocks))
    assert max(used) == 8  # ceil(60 / 8), held to the end


def test_a_real_sliding_window_model_holds_a_bounded_number_of_blocks(
        tiny_model_dir: Callable[..., Path]) -> None:
    path = tiny_model_dir("MistralForCausalLM", sliding_window=12, max_position_embeddings=256)
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", block_size=8,
                                    num_kv_blocks=64, max_model_len=128, enable_prefix_caching=False))
    assert engine.runner.kv_sliding_window == 12  # type: ignore[attr-defined]
    assert engine.block_manager.sliding_window == 12
    used: list[int] = []
    outputs = run(engine, {"a": (list(range(3, 23)), 60)},
                  lambda: used.append(engine.block_manager.num_used_blocks))
    assert len(outputs["a"]) == 60
    assert max(used[:-1]) == 3, "an 80-token sequence would hold 10 blocks without the release"


# --- memory bounds that follow the window ----------------------------------------------------------------


def bound_of(window: int, block_size: int, num_tokens: int, max_batched: int, threshold: int) -> int:
    config = EngineConfig(model="unused", max_num_batched_tokens=max_batched,
                          long_prefill_token_threshold=threshold)
    return max_blocks_held(num_tokens, block_size, window, max_chunk_tokens(config))


@pytest.mark.parametrize(("window", "block_size", "max_batched", "threshold"),
                         [(12, 8, 16, 8), (7, 8, 9, 0), (20, 16, 64, 512), (1, 8, 5, 0)])
def test_a_lone_long_sequence_runs_in_a_cache_of_exactly_its_bound(
        tokenizer: Tokenizer, window: int, block_size: int, max_batched: int, threshold: int) -> None:
    bound = bound_of(window, block_size, 210, max_batched, threshold)
    assert bound < -(-210 // block_size)
    runner = WindowRunner(window, num_kv_blocks=bound, block_size=block_size, max_model_len=256,
                          vocab_size=VOCAB)
    engine = make_engine(tokenizer, runner, max_num_batched_tokens=max_batched,
                         long_prefill_token_threshold=threshold)
    tokens = prompt(150)
    # The first leaves its prompt's last blocks cached; the second takes the window's of them, and generates
    # 60 tokens (210 in all) in a cache never emptier than its bound.
    for rid, max_tokens in (("first", 1), ("again", 60)):
        assert run(engine, {rid: (tokens, max_tokens)}, lambda: None) == {
            rid: windowed_reference(tokens, max_tokens, window)}
        assert engine.block_manager.num_used_blocks == 0
    assert engine.scheduler.num_preemptions == 0
    assert engine.totals.prefix_cache_hits > 0
    assert runner.max_blocks_in_a_table <= bound


def test_long_sequences_sharing_a_cache_of_one_bound_preempt_and_all_finish(tokenizer: Tokenizer) -> None:
    bound = bound_of(12, 8, 256, 16, 8)
    runner = WindowRunner(12, num_kv_blocks=bound, block_size=8, max_model_len=256, vocab_size=VOCAB)
    engine = make_engine(tokenizer, runner, max_num_batched_tokens=16, long_prefill_token_threshold=8)
    requests = {f"r{i}": ([*prompt(40), *prompt(60 + 10 * i, i)], 30) for i in range(3)}
    outputs = run(engine, requests, lambda: None)
    assert outputs == {rid: windowed_reference(p, n, 12) for rid, (p, n) in requests.items()}
    assert engine.scheduler.num_preemptions > 0
    assert runner.max_blocks_in_a_table <= bound and engine.block_manager.num_used_blocks == 0


def make_inputs(tokenizer: Tokenizer, bm: BlockManager, *, pooling: PoolingConfig | None = None,
                **config: int) -> InputProcessor:
    return InputProcessor(EngineConfig(model="unused", **config), tokenizer, bm, Sampler("cpu"),
                          max_model_len=1024, vocab_size=VOCAB, pooling=pooling,
                          embedding_size=64 if pooling is not None else None)


def test_a_windowed_engine_accepts_a_request_longer_than_its_cache_when_the_bound_fits(
        tokenizer: Tokenizer) -> None:
    # 500 tokens are 32 blocks of 16; with window 16 and chunks of 64, at most 1 + ceil(78 / 16) = 6 at once.
    params = SamplingParams(max_tokens=100)
    windowed = make_inputs(tokenizer, BlockManager(6, 16, sliding_window=16), max_num_batched_tokens=64)
    assert windowed.make_sequence("a", prompt(400), params).num_tokens == 400
    too_small = make_inputs(tokenizer, BlockManager(5, 16, sliding_window=16), max_num_batched_tokens=64)
    with pytest.raises(ValueError, match=r"max_tokens \(100\) \+ prompt \(400 tokens\) need 6 KV blocks "
                                         r"at once \(sliding window 16, chunks up to 64 tokens\); the cache "
                                         r"has 5"):
        too_small.make_sequence("a", prompt(400), params)
    # long_prefill_token_threshold caps a chunk too: 32 tokens, 1 + ceil(46 / 16) = 4 blocks.
    capped = make_inputs(tokenizer, BlockManager(4, 16, sliding_window=16), long_prefill_token_threshold=32)
    assert capped.make_sequence("a", prompt(400), params).num_tokens == 400


def test_without_a_window_a_request_needs_all_its_blocks(tokenizer: Tokenizer) -> None:
    params = SamplingParams(max_tokens=100)
    assert make_inputs(tokenizer, BlockManager(32, 16)).make_sequence("a", prompt(400), params)
    with pytest.raises(ValueError, match=r"need 32 KV blocks; the cache has 31"):
        make_inputs(tokenizer, BlockManager(31, 16)).make_sequence("a", prompt(400), params)


def test_a_windowed_embedding_input_is_sized_by_the_bound(tokenizer: Tokenizer) -> None:
    pooling = PoolingConfig(method="last", normalize=True, max_length=None)
    fits = make_inputs(tokenizer, BlockManager(6, 16, sliding_window=16), pooling=pooling,
                       max_num_batched_tokens=64)
    assert fits.make_sequence("e", prompt(500), PoolingParams()).num_tokens == 500
    too_small = make_inputs(tokenizer, BlockManager(5, 16, sliding_window=16), pooling=pooling,
                            max_num_batched_tokens=64)
    with pytest.raises(ValueError, match=r"input \(500 tokens\) needs 6 KV blocks at once \(sliding window"):
        too_small.make_sequence("e", prompt(500), PoolingParams())


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_a_real_windowed_model_runs_a_long_context_in_a_small_cache_exactly(
        tiny_model_dir: Callable[..., Path], backend: str) -> None:
    """400 prompt tokens and 100 generated ones (32 blocks of 16) in a cache of 12 blocks; a sequence holds 6
    at most (window 16, chunks of 64): token for token transformers' generate. The same prompt again takes
    its cached prefix (the window's blocks of it, the head is evicted by then) and generates the same."""
    path = tiny_model_dir("MistralForCausalLM", sliding_window=16, max_position_embeddings=1024)
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", num_kv_blocks=12,
                                    block_size=16, max_model_len=1024, max_num_batched_tokens=64,
                                    attention_backend=backend))
    assert engine.block_manager.sliding_window == 16 and engine.block_manager.prefix_cache is not None
    tokens = [3 + (i * 37) % (engine.vocab_size - 3) for i in range(400)]
    held: list[int] = []
    execute = engine.runner.execute

    def recording_execute(chunks: list[ScheduledChunk]) -> RunnerOutput:
        held.append(max(sum(b != RELEASED for b in c.block_table) for c in chunks))
        return execute(chunks)

    engine.runner.execute = recording_execute  # type: ignore[method-assign]
    first, again = (generate(engine, rid, tokens, 100) for rid in ("first", "again"))
    assert first.token_ids == hf_greedy(path, tuple(tokens), 100)
    # 5 here: the prefill chunks start on block boundaries (positions c - 15 .. c + 63 touch 5 blocks); 6 for
    # the worst alignment. 500 tokens would need 32 blocks.
    assert max(held) <= 6
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 384  # 24 blocks; 16 tokens recomputed
    assert again.token_ids == first.token_ids
    assert engine.block_manager.num_used_blocks == 0


def generate(engine: LLMEngine, request_id: str, tokens: list[int], max_tokens: int) -> RequestOutput:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(request_id, tokens, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    assert final is not None and final.finish_reason == "length"
    return final


@cache
def hf_greedy(path: Path, tokens: tuple[int, ...], max_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([tokens])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(tokens) :].tolist()
