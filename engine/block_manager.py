"""Owns the paged KV cache's blocks: a free list, reference counts, every sequence's block table, and (when
prefix caching is on) the prefix cache that lets sequences share the full blocks of a common prefix."""

from __future__ import annotations

from collections import deque

from engine.prefix_cache import PrefixCache, block_hashes
from engine.sequence import Sequence


class BlockManager:
    """Hands out physical block ids in a fixed order, so tests can assert exact ids.

    Every block is in exactly one state: *free* (holds nothing reusable; on `_free`, handed out first),
    *evictable* (cached content, no holder; handed out least recently used first, which evicts it), or
    *held* by the sequences whose tables name it, reference count = their number. Only full blocks whose K/V
    a successful step computed are cached; a sequence's last, partial block is always private.

    A sequence's table covers exactly ceil(tokens / block_size) blocks, so only its last block has unused
    slots.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
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
        """The longest chain of cached blocks that starts seq's tokens (seq holds no blocks yet).

        NOTE: it stops short of seq's last token, which must be computed for its logits; a fully cached prompt
        of whole blocks recomputes its last block into a new one rather than write into a shared block.
        """
        assert not seq.block_table, f"{seq.request_id} already has blocks"
        if self.prefix_cache is None:
            return []
        hits: list[int] = []
        for block_hash in block_hashes(seq, self.block_size, (seq.num_tokens - 1) // self.block_size):
            block = self.prefix_cache.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def next_block_hash(self, seq: Sequence, num_cached_blocks: int) -> bytes | None:
        """The hash of the block seq would compute right after its cached ones, if that block is full."""
        if self.prefix_cache is None or (num_cached_blocks + 1) * self.block_size >= seq.num_tokens:
            return None
        return block_hashes(seq, self.block_size, num_cached_blocks + 1)[num_cached_blocks]

    def can_allocate(self, num_tokens: int, cached: list[int] | None = None) -> bool:
        """Room for a sequence that takes the `cached` blocks, then computes num_tokens tokens after them."""
        cached = cached or []
        needed = self.blocks_for_tokens(len(cached) * self.block_size + num_tokens) - len(cached)
        revived = sum(1 for block in cached if self._ref_counts[block] == 0)  # evictable ones stop being free
        return needed <= self.num_free_blocks - revived

    def allocate(self, seq: Sequence, num_tokens: int, cached: list[int] | None = None) -> None:
        """Gives a sequence with no blocks the `cached` blocks, then blocks for num_tokens tokens beyond."""
        assert not seq.block_table and seq.num_computed_tokens == 0, f"{seq.request_id} already has blocks"
        cached = cached or []
        if not self.can_allocate(num_tokens, cached):
            raise RuntimeError(f"out of KV blocks: {seq.request_id} needs more than {self.num_free_blocks}")
        for block in cached:
            self._hold(block)
        seq.block_table.extend(cached)
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

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Registers seq's full blocks up to num_computed_tokens in the prefix cache.

        Call it only once the step that computed them has succeeded: a block is found by others only when its
        K/V are all there (a failed step may leave a block half written, layer by layer).
        """
        num_full = seq.num_computed_tokens // self.block_size
        if self.prefix_cache is None or num_full <= seq.num_registered_blocks:
            return
        hashes = block_hashes(seq, self.block_size, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            self.prefix_cache.insert(seq.block_table[i], hashes[i])  # False: a copy is cached already
        seq.num_registered_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Releases every block of seq, the last block first: among equally old cached blocks, a deeper one
        (less likely to be shared) is evicted before its parent."""
        for block in reversed(seq.block_table):
            assert self._ref_counts[block] > 0, f"block {block} of {seq.request_id} freed twice"
            self._ref_counts[block] -= 1
            if self._ref_counts[block] > 0:
                continue
            if self.prefix_cache is not None and self.prefix_cache.is_cached(block):
                self.prefix_cache.release(block)
            else:
                self._free.append(block)
        seq.block_table.clear()
        seq.num_registered_blocks = 0

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
