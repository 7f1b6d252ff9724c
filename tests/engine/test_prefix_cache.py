"""The prefix cache in the block manager, without a model: hashes, hits, sharing, and exact eviction order."""

from __future__ import annotations

from conveyor.engine.block_manager import BlockManager
from conveyor.engine.prefix_cache import ROOT_HASH, block_hashes, hash_block, salt_root
from conveyor.engine.sequence import Sequence
from tests.support.engine import make_seq

BS = 4


def admit(bm: BlockManager, seq: Sequence) -> list[int]:
    """What the scheduler and engine do for a new request computed in one step; returns its cache hits."""
    hits = bm.cached_prefix(seq)
    cached_tokens = len(hits) * BS
    bm.allocate(seq, seq.num_tokens - cached_tokens, hits)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq)
    return hits


def test_the_hash_chains_the_whole_prefix() -> None:
    a, b = hash_block(ROOT_HASH, [1, 2, 3, 4]), hash_block(ROOT_HASH, [9, 2, 3, 4])
    assert len(a) == 32 and a != b
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(b, [5, 6, 7, 8]), "same block, different prefix"
    seq = make_seq("s", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert block_hashes(seq, BS, 2) == [a, hash_block(a, [5, 6, 7, 8])]


def test_a_salt_seeds_the_chain_in_place_of_the_empty_root() -> None:
    root = salt_root("tenant:a")
    assert salt_root(None) == ROOT_HASH
    assert len(root) == 32 and root not in (salt_root("tenant:b"), hash_block(ROOT_HASH, [1, 2, 3, 4]))
    seq = make_seq("s", [1, 2, 3, 4, 5, 6, 7, 8, 9], cache_salt="tenant:a")
    first = hash_block(root, [1, 2, 3, 4])
    assert block_hashes(seq, BS, 2) == [first, hash_block(first, [5, 6, 7, 8])]


def test_equal_prompts_under_different_salts_share_no_block() -> None:
    bm = BlockManager(num_blocks=12, block_size=BS, enable_prefix_caching=True)
    tokens = list(range(10, 19))  # two full blocks + 1
    a = make_seq("a", tokens, cache_salt="tenant:a")
    assert admit(bm, a) == []
    assert a.block_table == [0, 1, 2]
    b = make_seq("b", tokens, cache_salt="tenant:b")
    assert admit(bm, b) == [], "another salt's blocks are not hits"
    assert b.block_table == [3, 4, 5]
    unsalted = make_seq("u", tokens)
    assert admit(bm, unsalted) == [], "an unsalted request does not see salted blocks"
    assert unsalted.block_table == [6, 7, 8]
    assert bm.cached_prefix(make_seq("a2", [*tokens, 1], cache_salt="tenant:a")) == [0, 1]
    assert bm.cached_prefix(make_seq("b2", [*tokens, 1], cache_salt="tenant:b")) == [3, 4]
    assert bm.cached_prefix(make_seq("u2", [*tokens, 1])) == [6, 7]
    assert bm.cached_prefix(make_seq("c", [*tokens, 1], cache_salt="tenant:c")) == []


def test_a_salted_requests_blocks_stay_cached_for_its_salt_after_free() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS, enable_prefix_caching=True)
    a = make_seq("a", list(range(10, 19)), cache_salt="namespace:shared")
    admit(bm, a)
    bm.free(a)
    assert bm.evictable_block_ids() == [1, 0]
    assert bm.cached_prefix(make_seq("other", list(range(10, 19)), cache_salt="tenant:x")) == []
    again = make_seq("again", [*range(10, 18), 42], cache_salt="namespace:shared")
    assert admit(bm, again) == [0, 1]
    assert again.block_table == [0, 1, 3]


def test_a_shared_prefix_is_computed_once_and_the_partial_last_block_is_private() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    prefix = list(range(10, 18))  # two full blocks
    a, b = make_seq("a", [*prefix, 1, 2]), make_seq("b", [*prefix, 3, 4, 5])
    assert admit(bm, a) == []
    assert a.block_table == [0, 1, 2]
    assert admit(bm, b) == [0, 1]
    assert b.block_table == [0, 1, 3]
    assert [bm.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    assert bm.num_used_blocks == 4


def test_a_fully_cached_prompt_still_computes_its_last_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    tokens = list(range(10, 22))  # exactly three blocks
    first, again = make_seq("first", tokens), make_seq("again", tokens)
    admit(bm, first)
    hits = bm.cached_prefix(again)
    assert hits == [0, 1], "the last block is recomputed: its last token's logits are needed"
    bm.allocate(again, 4, hits)
    assert again.block_table == [0, 1, 3]
    again.num_computed_tokens = 12
    bm.cache_computed_blocks(again)  # an equal block is cached already: block 3 stays private
    bm.free(again)
    assert bm.free_block_ids() == [4, 5, 6, 7, 3]
    assert bm.evictable_block_ids() == []  # blocks 0-2 are still held by `first`


def test_freed_blocks_stay_cached_and_are_evicted_least_recently_used_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS, enable_prefix_caching=True)
    a, b = make_seq("a", list(range(10, 19))), make_seq("b", list(range(30, 38)))
    admit(bm, a)  # blocks 0, 1 full (cached), 2 partial
    admit(bm, b)  # blocks 3, 4 full (cached)
    bm.free(a)
    bm.free(b)
    # Partial block 2 holds nothing reusable: free. Cached ones in release order, a's last block first.
    assert bm.free_block_ids() == [5, 2, 1, 0, 4, 3]
    assert bm.evictable_block_ids() == [1, 0, 4, 3]
    assert bm.num_free_blocks == 6 and bm.num_used_blocks == 0

    c = make_seq("c", list(range(50, 66)))  # 4 new blocks: the 2 free ones, then evicts 1 and 0
    assert admit(bm, c) == []
    assert c.block_table == [5, 2, 1, 0]
    assert bm.num_evictions == 2
    assert bm.cached_prefix(make_seq("a2", list(range(10, 19)))) == [], "a's prefix was evicted"
    assert bm.cached_prefix(make_seq("b2", [*range(30, 38), 7])) == [3, 4], "b's is still there"


def test_a_hit_takes_an_evictable_block_back_and_lookup_stops_at_the_first_miss() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    a = make_seq("a", list(range(10, 23)))  # 3 full blocks + 1 token
    admit(bm, a)
    bm.free(a)
    assert bm.evictable_block_ids() == [2, 1, 0]
    diverging = make_seq("d", [*range(10, 18), 99, 99, 99, 99, 5])  # shares the first two blocks only
    assert bm.can_allocate(5, [0, 1]) and not bm.can_allocate(9, [0, 1])
    assert admit(bm, diverging) == [0, 1]
    assert diverging.block_table == [0, 1, 3, 2], "free block 3 first, then evict 2"
    assert bm.num_evictions == 1 and bm.evictable_block_ids() == []


def test_reset_forgets_unheld_cached_blocks_only() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS, enable_prefix_caching=True)
    a, b = make_seq("a", list(range(10, 19))), make_seq("b", list(range(10, 19)))
    admit(bm, a)
    admit(bm, b)
    bm.free(a)  # b still holds blocks 0 and 1
    assert bm.reset_prefix_cache() == 0
    bm.free(b)
    assert bm.reset_prefix_cache() == 2
    assert bm.evictable_block_ids() == [] and bm.num_free_blocks == 6
    assert bm.cached_prefix(make_seq("c", list(range(10, 19)))) == []


def test_with_caching_off_nothing_is_shared() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = make_seq("a", list(range(10, 19))), make_seq("b", list(range(10, 19)))
    assert admit(bm, a) == [] and admit(bm, b) == []
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4, 5]
    bm.free(a)
    assert bm.free_block_ids() == [6, 7, 2, 1, 0] and bm.num_evictions == 0
