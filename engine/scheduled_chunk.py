"""What the scheduler hands the model runner for one step, and what the runner hands back (the contract
between the two halves)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ScheduledChunk:
    """The tokens one sequence computes this step: a prefill chunk or one decode token."""

    token_ids: list[int]  # the tokens to run through the model this step
    start_pos: int  # position of token_ids[0] (= tokens already in the KV cache)
    block_table: list[int]  # physical KV blocks of the sequence, covering start_pos + len(token_ids)
    sample: bool  # True when the chunk ends at the sequence's last known token: logits are needed
    # Prompt logprobs (SamplingParams.prompt_logprobs): the top-k to return, and the prompt tokens that the
    # chunk's first len(prompt_targets) positions predict (prompt tokens start_pos + 1 onwards). None: none.
    prompt_logprobs: int | None = None
    prompt_targets: list[int] = field(default_factory=list)
    lora: str | None = None  # the key of its LoRA adapter (engine/lora/manager.py); None: the base model
    # Speculation: how many of token_ids, at the end, are drafts after the sequence's last token. A sampling
    # chunk gets one logits row per draft plus one: its last 1 + num_draft_tokens positions.
    num_draft_tokens: int = 0

    @property
    def num_logits_rows(self) -> int:
        return 1 + self.num_draft_tokens if self.sample else 0

    @property
    def seq_len(self) -> int:
        """Tokens in the cache once this step has run."""
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class ChunkPromptLogprobs:
    """One chunk's prompt logprobs, on the CPU: row i scores prompt token start_pos + i + 1 given those
    before it, under the raw model distribution (float32 log-softmax)."""

    token_ids: torch.Tensor  # [n] int64: the prompt tokens scored (the chunk's prompt_targets)
    token_logprobs: torch.Tensor  # [n] fp32: their logprobs
    top_ids: torch.Tensor  # [n, k] int64: the k most likely tokens at each position, most likely first
    top_logprobs: torch.Tensor  # [n, k] fp32: their logprobs

    def entries(self) -> list[dict[int, float]]:
        """Per scored token: {token id: logprob} with the top-k tokens and the prompt token itself."""
        rows = zip(self.top_ids.tolist(), self.top_logprobs.tolist(), self.token_ids.tolist(),
                   self.token_logprobs.tolist(), strict=True)
        return [dict(zip(ids, values, strict=True)) | {token: lp} for ids, values, token, lp in rows]


@dataclass(frozen=True)
class RunnerOutput:
    logits: torch.Tensor  # [sum of the chunks' num_logits_rows, V] fp32, in chunk order
    prompt_logprobs: list[ChunkPromptLogprobs | None]  # one per chunk: None where it asked for none
    # An embedding runner's: one fp32 row per chunk [S, H], on the CPU, what pooling needs of the chunk's
    # hidden states (engine/pooling.py chunk_rows). None from a generation runner.
    pooled: torch.Tensor | None = None
