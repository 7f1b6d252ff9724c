"""What the scheduler hands the model runner for one step (the contract between the two halves)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduledChunk:
    """The tokens one sequence computes this step: a prefill chunk or one decode token."""

    token_ids: list[int]  # the tokens to run through the model this step
    start_pos: int  # position of token_ids[0] (= tokens already in the KV cache)
    block_table: list[int]  # physical KV blocks of the sequence, covering start_pos + len(token_ids)
    sample: bool  # True when the chunk ends at the sequence's last known token: logits are needed

    @property
    def seq_len(self) -> int:
        """Tokens in the cache once this step has run."""
        return self.start_pos + len(self.token_ids)
