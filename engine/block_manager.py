"""Owns the paged KV cache's blocks: a free list, reference counts, every sequence's block table, and (when
prefix caching is on) the prefix cache that lets sequences share the full blocks of a common prefix.

Sliding-window models (every layer attends within the same window W) release a running sequence's blocks
that lie entirely before the window of its next query: no later query reads them. A new sequence does not
even take the cached prefix blocks before the window of its first computed token, so a sequence never holds
more than `max_blocks_held` blocks, however long it grows: the cache, and each request, are sized by it.
"""

from __future__ import annotations

from collections import deque

from conveyor.engine.config import EngineConfig
from conveyor.engine.prefix_cache import PrefixCache, block_hashes
from conveyor.engine.sequence import Sequence

RELEASED = -1  # the table entry of a block released early (free_outside_window) or never taken (allocate)


def max_chunk_tokens(config: EngineConfig) -> int:
    """The most tokens of one sequence computed in one step: Scheduler._chunk_size caps a chunk by the step's
    budget (at most max_num_batched_tokens) and by long_prefill_token_threshold when that is set (0: none).

    NOTE: the chunked scheduler's; an encoder's (unchunked) steps may be longer, but encoders have no window.
    """
    threshold = config.long_prefill_token_threshold
    return min(config.max_num_batched_tokens, threshold) if threshold > 0 else config.max_num_batched_tokens


def max_blocks_held(num_tokens: int, block_size: int, sliding_window: int | None = None,
                    max_step_tokens: int | None = None) -> int:
    """The most KV blocks a sequence of num_tokens tokens ever holds at once.

    Without a window: all of them, ceil(num_tokens / bs). With window W and at most S = max_step_tokens
    tokens computed per step: a step computing positions c .. c + n - 1 (n <= S) runs while the sequence
    holds the blocks from the one of position c - W + 1 (those wholly before it were released after the last
    step, or never taken: allocate) through the one of c + n - 1: a span of L <= W - 1 + S positions. Its
    first position is in one block, and the other L - 1 positions reach at most ceil((L - 1) / bs) blocks
    beyond it (exactly that many when the span starts on a block's last slot): 1 + ceil((L - 1) / bs) in
    all (ceil(L / bs) + 1 is one too many when L % bs == 1, e.g. L = 1). When c - W + 1 < 0 the span is cut
    at 0, within the ceil(num_tokens / bs) blocks of the whole sequence. The minimum of the two is reached
    for every num_tokens (tests/engine/test_block_manager.py checks every c and n by brute force).
    """
    all_blocks = -(-num_tokens // block_size)
    if sliding_window is None:
        return all_blocks
    assert max_step_tokens is not None and max_step_tokens >= 1, "a window needs the step's token cap"
    span = sliding_window - 1 + max_step_tokens
    return min(all_blocks, 1 + -(-(span - 1) // block_size))


class BlockManager:
    """Hands out physical block ids in a fixed order, so tests can assert exact ids.

    Every block is in exactly one state: *free* (holds nothing reusable; on `_free`, handed out first),
    *evictable* (cached content, no holder; handed out least recently used first, which evicts it), or
    *held* by the sequences whose tables name it, reference count = their number. Only full blocks whose K/V
    a successful step computed are cached; a sequence's last, partial block is always private.

    A sequence's table covers exactly ceil(tokens / block_size) blocks, so only its last block has unused
    slots. With a sliding window, its first `seq.num_released_blocks` entries may be RELEASED: the table keeps
    its length, since a token's slot is found by its logical block index.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 sliding_window: int | None = None) -> None:
        assert num_blocks >= 1 and block_size >= 1
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # The window W every layer attends within; None: some layer attends to the whole context (Gemma's
        # global layers, or a model without windows), so every block stays held.
        self.sliding_window = sliding_window
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can get: free ones plus evictable cached ones."""
        evictable = self.prefix_cache.num_evictable if self.prefix_cache is not None else 0
        return len(self._free) + evictable

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_evictions(self) -> int:
        return self.prefix_cache.num_evictions if self.prefix_cache is not None else 0

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so the table covers the computed tokens plus num_new_tokens more."""
        needed = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    # --- new sequences -------------------------------------------------------------------------------

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The head of the table seq starts with (it holds no blocks yet): one entry per leading full block
        it need not compute, its cached block, or RELEASED for a block before the window (below).

        Without a window: the longest chain of cached blocks from block 0. With window W: the longest prefix
        of h blocks such that the blocks its first computed query (at c = h * bs) reads, from the one of
        position c - W + 1 on, are cached; the entries before them are RELEASED, cached or not: no query of
        seq reads them, so allocate does not take them, and an evicted head does not cost a long prompt its
        hits. The prefix's last block must be cached even when the window needs none of it (W = 1): an empty
        cache gives no hits.

        NOTE: it stops short of seq's last token, which must be computed for its logits; a fully cached prompt
        of whole blocks recomputes its last block into a new one rather than write into a shared block.
        """
        assert not seq.block_table, f"{seq.request_id} already has blocks"
        if self.prefix_cache is None:
            return []
        found = self._lookup_blocks(seq, self.prefix_cache)
        num_hits = self._num_hit_blocks(found)
        skip = self._num_blocks_before(num_hits * self.block_size)
        held = [block for block in found[skip:num_hits] if block is not None]
        assert len(held) == num_hits - skip, (seq.request_id, found, num_hits, skip)
        return [RELEASED] * skip + held

    def next_block_hash(self, seq: Sequence, num_cached_blocks: int) -> bytes | None:
        """The hash of the block seq would compute right after its cached ones, if that block is full."""
        if self.prefix_cache is None or (num_cached_blocks + 1) * self.block_size >= seq.num_tokens:
            return None
        return block_hashes(seq, self.block_size, num_cached_blocks + 1)[num_cached_blocks]

    def can_allocate(self, num_tokens: int, cached: list[int] | None = None) -> bool:
        """Room for a sequence that starts with the `cached` table head (cached_prefix), then computes
        num_tokens tokens after it: the new blocks, and the cached ones it takes (`_taken_hits`)."""
        cached = cached or []
        needed = self.blocks_for_tokens(len(cached) * self.block_size + num_tokens) - len(cached)
        # An evictable hit it takes stops being free; a skipped one stays free (it may be evicted for it).
        revived = sum(1 for block in self._taken_hits(cached) if self._ref_counts[block] == 0)
        return needed <= self.num_free_blocks - revived

    def allocate(self, seq: Sequence, num_tokens: int, cached: list[int] | None = None) -> None:
        """Gives a sequence with no blocks the `cached` table head, then blocks for num_tokens tokens beyond.

        With a window, the cached blocks wholly before the window of its first query (at len(cached) * bs)
        are not taken: their entries are RELEASED at once, as free_outside_window would leave them after the
        step. They count as registered (they were hits: cached already, or evicted since, which nothing
        needs), so cache_computed_blocks registers the blocks after them.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0, f"{seq.request_id} already has blocks"
        cached = cached or []
        if not self.can_allocate(num_tokens, cached):
            raise RuntimeError(f"out of KV blocks: {seq.request_id} needs more than {self.num_free_blocks}")
        taken = self._taken_hits(cached)
        for block in taken:  # held before any new block is taken, so none of them is evicted for one
            self._hold(block)
        skip = len(cached) - len(taken)
        seq.block_table.extend([RELEASED] * skip + taken)
        seq.num_released_blocks = skip
        seq.num_registered_blocks = len(cached)
        new = self.blocks_for_tokens(len(cached) * self.block_size + num_tokens) - len(cached)
        seq.block_table.extend(self._take_free_block() for _ in range(new))

    # --- growing, caching, freeing -------------------------------------------------------------------

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grows seq's table to cover num_new_tokens tokens beyond those already computed."""
        n = self.num_new_blocks(seq, num_new_tokens)
        if n > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: {seq.request_id} needs {n}, {self.num_free_blocks} free")
        seq.block_table.extend(self._take_free_block() for _ in range(n))

    def trim(self, seq: Sequence) -> None:
        """Releases seq's blocks past those its tokens fill: blocks taken for drafts that were rejected.
        They were taken fresh for the step and hold no computed token, so none is registered."""
        keep = self.blocks_for_tokens(seq.num_tokens)
        assert seq.num_registered_blocks <= keep, (seq.request_id, seq.num_registered_blocks, keep)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop(), seq.request_id)

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Registers seq's full blocks up to num_computed_tokens in the prefix cache.

        Call it only once the step that computed them has succeeded: a block is found by others only when its
        K/V are all there (a failed step may leave a block half written, layer by layer).
        """
        num_full = seq.num_computed_tokens // self.block_size
        if self.prefix_cache is None or num_full <= seq.num_registered_blocks:
            return
        # Entries become RELEASED only once registered (free_outside_window) or as hits (allocate), so no
        # RELEASED entry is ever registered.
        assert seq.num_released_blocks <= seq.num_registered_blocks, seq.request_id
        hashes = block_hashes(seq, self.block_size, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            self.prefix_cache.insert(seq.block_table[i], hashes[i])  # False: a copy is cached already
        seq.num_registered_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Releases every block of seq, the last block first: among equally old cached blocks, a deeper one
        (less likely to be shared) is evicted before its parent. Blocks released early are skipped."""
        for block in reversed(seq.block_table[seq.num_released_blocks :]):
            self._release(block, seq.request_id)
        seq.block_table.clear()
        seq.num_registered_blocks = 0
        seq.num_released_blocks = 0

    def free_outside_window(self, seq: Sequence) -> int:
        """Releases the blocks of seq that lie entirely before the window of its next query; returns how many
        it released now (0 without a sliding window).

        Each is released as `free` releases it: a cached block nobody else holds becomes evictable (still a
        prefix-cache hit for others until evicted), a shared one stays held by its other holders. Its entry
        becomes RELEASED. Call it after cache_computed_blocks, for a sequence whose step succeeded: a released
        block must already be registered (or it would be lost to the cache), and its K/V complete.
        """
        start, end = seq.num_released_blocks, self._num_blocks_before_window(seq)
        if end <= start:
            return 0
        assert end <= len(seq.block_table), (seq.request_id, end, len(seq.block_table))
        assert self.prefix_cache is None or end <= seq.num_registered_blocks, (
            f"{seq.request_id}: blocks released before cache_computed_blocks registered them")
        for i in reversed(range(start, end)):  # the deepest first, as `free` does
            self._release(seq.block_table[i], seq.request_id)
            seq.block_table[i] = RELEASED
        seq.num_released_blocks = end
        return end - start

    def reset_prefix_cache(self) -> int:
        """Forgets the content of every cached block no sequence holds (now free); returns how many."""
        if self.prefix_cache is None:
            return 0
        dropped = self.prefix_cache.drop_evictable()
        self._free.extend(dropped)
        return len(dropped)

    # --- inspection ----------------------------------------------------------------------------------

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def free_block_ids(self) -> list[int]:
        """Every block a sequence can get, in the order they are handed out: free, then evictable (LRU)."""
        evictable = self.prefix_cache.evictable_ids() if self.prefix_cache is not None else []
        return list(self._free) + evictable

    def evictable_block_ids(self) -> list[int]:
        return self.prefix_cache.evictable_ids() if self.prefix_cache is not None else []

    # --- internals -----------------------------------------------------------------------------------

    def _num_blocks_before_window(self, seq: Sequence) -> int:
        """How many leading blocks of seq no query of it reads from now on."""
        return self._num_blocks_before(seq.num_computed_tokens)

    def _num_blocks_before(self, c: int) -> int:
        """How many leading blocks no query at position c or later reads (c: a sequence's next query).

        A query at p reads keys k with p - W < k <= p, so no key before c - W + 1 is read again. Block i holds
        positions i * bs .. (i + 1) * bs - 1: it is never read again iff (i + 1) * bs - 1 < c - W + 1, that is
        (i + 1) * bs <= c - W + 1. That holds for i = 0 .. n - 1 with n = (c - W + 1) // bs (floored; 0 while
        c - W + 1 < bs). E.g. W = 5, bs = 4: c = 8 or 9 frees block 0 (query 8 reads 4..8), c = 12 block 1.
        """
        if self.sliding_window is None:
            return 0
        return max(0, (c - self.sliding_window + 1) // self.block_size)

    def _taken_hits(self, cached: list[int]) -> list[int]:
        """The blocks of a `cached` table head that a new sequence holds: from the window of its first query
        (at len(cached) * bs) on; every one of them without a window."""
        taken = cached[self._num_blocks_before(len(cached) * self.block_size) :]
        assert RELEASED not in taken, f"a hit in the window was not found: {cached}"
        return taken

    def _lookup_blocks(self, seq: Sequence, cache: PrefixCache) -> list[int | None]:
        """The cached block of each of seq's full blocks before its last token (None: not cached); without a
        window, up to the first miss (a chain must start at block 0)."""
        found: list[int | None] = []
        for block_hash in block_hashes(seq, self.block_size, (seq.num_tokens - 1) // self.block_size):
            block = cache.lookup(block_hash)
            if block is None and self.sliding_window is None:
                break
            found.append(block)
        return found

    def _num_hit_blocks(self, found: list[int | None]) -> int:
        """The longest prefix h whose blocks the query at h * bs reads are all found: blocks
        _num_blocks_before(h * bs) .. h - 1, and block h - 1 at least (see cached_prefix)."""
        best = run = 0  # run: found blocks in a row ending at block i
        for i, block in enumerate(found):
            run = run + 1 if block is not None else 0
            needed = max(1, i + 1 - self._num_blocks_before((i + 1) * self.block_size))
            if run >= needed:
                best = i + 1
        return best

    def _release(self, block: int, request_id: str) -> None:
        """One holder fewer; a block nobody holds becomes evictable if cached (content kept), else free."""
        # NOTE: a RELEASED (-1) entry reaching here would silently index the last block's count.
        assert 0 <= block < self.num_blocks, f"block {block} of {request_id} is not a block"
        assert self._ref_counts[block] > 0, f"block {block} of {request_id} freed twice"
        self._ref_counts[block] -= 1
        if self._ref_counts[block] > 0:
            return
        if self.prefix_cache is not None and self.prefix_cache.is_cached(block):
            self.prefix_cache.release(block)
        else:
            self._free.append(block)

    def _hold(self, block: int) -> None:
        """One more holder for a cached block (a hit); an evictable one is taken off the eviction order."""
        assert self.prefix_cache is not None and self.prefix_cache.is_cached(block), block
        if self._ref_counts[block] == 0:
            self.prefix_cache.reclaim(block)
        self._ref_counts[block] += 1

    def _take_free_block(self) -> int:
        """A free block if there is one, else the least recently used evictable block (evicted)."""
        if self._free:
            block = self._free.popleft()
        else:
            assert self.prefix_cache is not None and self.prefix_cache.num_evictable, "no block to take"
            block = self.prefix_cache.evict()
        assert self._ref_counts[block] == 0, f"block {block} handed out while in use"
        self._ref_counts[block] = 1
        return block
