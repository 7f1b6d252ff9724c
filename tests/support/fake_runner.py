"""A model-runner double for scheduler tests: a 'KV cache' of token ids and a next token that hashes it.

The next token is a function of every token the cache holds for the sequence (read back through its
block table), so any lost, shared or misplaced block changes the output: comparing with `reference()`
checks the block manager and scheduler end to end without a model.
"""

from __future__ import annotations

import torch

from conveyor.engine.scheduled_chunk import RunnerOutput, ScheduledChunk


def next_token(history: list[int], vocab_size: int) -> int:
    h = 0
    for i, t in enumerate(history):
        h = (h * 31 + t * (i + 7)) % 1_000_003
    return 3 + h % (vocab_size - 3)  # never 0..2 (pad, bos, eos)


def reference(prompt: list[int], max_tokens: int, vocab_size: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens, vocab_size))
    return tokens[len(prompt) :]


class FakeRunner:
    def __init__(
        self, num_kv_blocks: int = 64, block_size: int = 16, max_model_len: int = 512, vocab_size: int = 64
    ) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.hf_config: dict[str, object] = {}
        self.last_forward_seconds = 0.0
        self.cache = torch.full((num_kv_blocks, block_size), -1, dtype=torch.long)
        self.steps: list[list[ScheduledChunk]] = []

    def execute(self, chunks: list[ScheduledChunk]) -> RunnerOutput:
        """Logits only: a fake scores no prompt (prompt_logprobs: None per chunk)."""
        self.steps.append(chunks)
        rows = []
        for chunk in chunks:
            self._check_table(chunk)
            for i, token in enumerate(chunk.token_ids):
                self._write(chunk.block_table, chunk.start_pos + i, token)
            # One row per sampled position: the last, or with drafts the last 1 + num_draft_tokens.
            for end in range(chunk.seq_len - chunk.num_logits_rows + 1, chunk.seq_len + 1):
                history = [self._read(chunk.block_table, p) for p in range(end)]
                row = torch.zeros(self.vocab_size)
                row[self.next_token(history)] = 20.0
                rows.append(row)
        logits = torch.stack(rows) if rows else torch.zeros(0, self.vocab_size)
        return RunnerOutput(logits, [None] * len(chunks))

    def next_token(self, history: list[int]) -> int:
        """The token the 'model' predicts after `history` (what it reads back from its cache)."""
        return next_token(history, self.vocab_size)

    def _check_table(self, chunk: ScheduledChunk) -> None:
        needed = -(-chunk.seq_len // self.block_size)
        assert len(chunk.block_table) == needed, f"table {chunk.block_table} for {chunk.seq_len} tokens"
        assert len(set(chunk.block_table)) == len(chunk.block_table)
        assert chunk.seq_len <= self.max_model_len

    def _write(self, table: list[int], pos: int, token: int) -> None:
        self.cache[table[pos // self.block_size], pos % self.block_size] = token

    def _read(self, table: list[int], pos: int) -> int:
        return int(self.cache[table[pos // self.block_size], pos % self.block_size])


class FailingRunner(FakeRunner):
    """Raises on the steps whose (0-based) index is in fail_on."""

    def __init__(self, fail_on: set[int], **kwargs: int) -> None:
        super().__init__(**kwargs)
        self.fail_on = fail_on
        self.calls = 0

    def execute(self, chunks: list[ScheduledChunk]) -> RunnerOutput:
        self.calls += 1
        if self.calls - 1 in self.fail_on:
            raise RuntimeError("injected runner failure")
        return super().execute(chunks)
