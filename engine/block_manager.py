"""Owns the paged KV cache's blocks: a free list, reference counts, and every sequence's block table."""

from __future__ import annotations

from collections import deque

from engine.sequence import Sequence


class BlockManager:
    """Hands out physical block ids in free-list order, so tests can assert exact ids.

    A sequence's table covers exactly ceil(tokens / block_size) blocks, so only its last block has unused
    slots. Reference counts are 0 or 1 today (no prefix caching); they keep the accounting honest.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so the table covers the computed tokens plus num_new_tokens more."""
        needed = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for_tokens(num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Gives a sequence with no blocks enough blocks for its first num_tokens tokens."""
        assert not seq.block_table and seq.num_computed_tokens == 0, f"{seq.request_id} already has blocks"
        self.append_slots(seq, num_tokens)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= len(self._free)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grows seq's table to cover num_new_tokens tokens beyond those already computed."""
        n = self.num_new_blocks(seq, num_new_tokens)
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: {seq.request_id} needs {n}, {len(self._free)} free")
        for _ in range(n):
            block = self._free.popleft()
            assert self._ref_counts[block] == 0, f"block {block} on the free list is in use"
            self._ref_counts[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Releases every block of seq; the last block goes back to the free list first."""
        for block in reversed(seq.block_table):
            assert self._ref_counts[block] > 0, f"block {block} of {seq.request_id} freed twice"
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)
        seq.block_table.clear()

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def free_block_ids(self) -> list[int]:
        return list(self._free)
