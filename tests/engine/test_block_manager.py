from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.outputs import RequestMetrics
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


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
