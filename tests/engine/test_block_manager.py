from __future__ import annotations

import pytest

from conveyor.engine.block_manager import BlockManager, max_blocks_held, max_chunk_tokens
from conveyor.engine.config import EngineConfig
from conveyor.engine.outputs import RequestMetrics
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.scheduler import Scheduler
from conveyor.engine.sequence import Sequence


def make_seq(request_id: str, num_prompt_tokens: int) -> Sequence:
    return Sequence(
        request_id=request_id,
        prompt_token_ids=list(range(3, 3 + num_prompt_tokens)),
        params=SamplingParams(),
        request_class="default",
        priority=0,
        arrival_order=0,
        metrics=RequestMetrics(arrival_time=0.0),
    )


def test_allocate_hands_out_blocks_in_free_list_order() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq("a", 9), make_seq("b", 4)
    assert bm.can_allocate(9)
    bm.allocate(a, 9)
    bm.allocate(b, 4)
    assert a.block_table == [0, 1, 2]
    assert b.block_table == [3]
    assert (bm.num_used_blocks, bm.num_free_blocks) == (4, 4)
    assert all(bm.ref_count(i) == 1 for i in range(4))


def test_append_slots_grows_only_when_the_last_block_is_full() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq("a", 3)
    bm.allocate(seq, 3)
    seq.num_computed_tokens = 3
    assert bm.num_new_blocks(seq, 1) == 0  # slot 3 of block 0 is still free
    bm.append_slots(seq, 1)
    seq.num_computed_tokens = 4
    assert seq.block_table == [0]
    assert bm.num_new_blocks(seq, 5) == 2
    bm.append_slots(seq, 5)
    assert seq.block_table == [0, 1, 2]


def test_can_append_refuses_beyond_the_free_blocks() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq("a", 8)
    assert bm.can_allocate(8) and not bm.can_allocate(9)
    assert not bm.can_append(seq, 9)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.append_slots(seq, 9)
    assert seq.block_table == [] and bm.num_free_blocks == 2


def test_free_returns_blocks_last_block_first_and_they_are_reused_in_that_order() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = make_seq("a", 12), make_seq("b", 4)
    bm.allocate(a, 12)
    bm.allocate(b, 4)
    bm.free(a)
    assert a.block_table == []
    assert bm.free_block_ids() == [4, 5, 2, 1, 0]
    c = make_seq("c", 8)
    bm.allocate(c, 8)
    assert c.block_table == [4, 5]
    assert bm.ref_count(0) == 0 and bm.ref_count(3) == 1


def test_double_free_is_caught() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    a = make_seq("a", 4)
    bm.allocate(a, 4)
    stale = list(a.block_table)
    bm.free(a)
    a.block_table.extend(stale)  # a corrupted table pointing at a freed block
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(a)


# --- the most blocks a sequence holds at once ------------------------------------------------------------


def most_held_by_brute_force(max_tokens: int, block_size: int, window: int, step: int) -> list[int]:
    """most[t]: the most blocks a sequence of t tokens holds at once, over every step it could run (c tokens
    computed, n <= step more, c + n <= t). During it, block i is held iff it exists (i * bs < c + n) and is
    not wholly before the window of the query at c ((i + 1) * bs > c - W + 1: those were released)."""
    most = [0] * (max_tokens + 1)
    for end in range(1, max_tokens + 1):  # end = c + n
        here = 0
        for n in range(1, min(step, end) + 1):
            c = end - n
            first = c - window + 1  # the first key the query at c reads
            held = sum(1 for i in range(end) if i * block_size < end and (i + 1) * block_size > first)
            here = max(here, held)
        most[end] = max(most[end - 1], here)
    return most


@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 5])
def test_the_bound_is_the_most_blocks_held_for_every_alignment(block_size: int) -> None:
    for window in range(1, 10):
        for step in range(1, 7):
            most = most_held_by_brute_force(36, block_size, window, step)
            for num_tokens in range(1, 37):
                assert max_blocks_held(num_tokens, block_size, window, step) == most[num_tokens], (
                    num_tokens, block_size, window, step)


def test_the_bound_without_a_window_is_every_block() -> None:
    for num_tokens in range(1, 50):
        assert max_blocks_held(num_tokens, 16) == -(-num_tokens // 16)
        assert max_blocks_held(num_tokens, 4, None, 3) == -(-num_tokens // 4)


def test_the_bound_of_a_long_sequence_is_the_window_and_one_chunk() -> None:
    # L = W - 1 + 64 positions touch at most 1 + ceil((L - 1) / 16) blocks.
    assert max_blocks_held(500, 16, 16, 64) == 6  # L = 79: 1 + 5
    assert max_blocks_held(500, 16, 18, 64) == 6  # L = 81 = 5 * 16 + 1: 1 + 5 (ceil(L / 16) + 1 says 7)
    assert max_blocks_held(500, 16, 19, 64) == 7  # L = 82: 1 + 6
    assert max_blocks_held(40, 16, 4096, 64) == 3  # never more than the sequence's own blocks


@pytest.mark.parametrize(("max_batched", "threshold", "expected"),
                         [(64, 512, 64), (2048, 32, 32), (48, 0, 48)])
def test_max_chunk_tokens_is_the_largest_chunk_the_scheduler_gives_one_sequence(
        max_batched: int, threshold: int, expected: int) -> None:
    config = EngineConfig(model="unused", max_num_batched_tokens=max_batched,
                          long_prefill_token_threshold=threshold)
    assert max_chunk_tokens(config) == expected
    scheduler = Scheduler(config, BlockManager(num_blocks=512, block_size=16), max_model_len=4096)
    seq = make_seq("a", 3000)
    scheduler.add(seq)
    assert [len(c.token_ids) for c in scheduler.schedule().chunks] == [expected]
