"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's logprob given the tokens before it,
and the top-k tokens at its position, under the raw model distribution.

The scheduler names, per prefill chunk, the prompt tokens its positions predict (`chunk_prompt_targets`);
the runner computes the logits at those positions and reduces them at once, in slices of rows
(`score_prompt_chunks`); the engine appends each chunk's entries to its sequence once the step succeeded.
A sequence collecting them takes no prefix-cache hits, so every position is computed; preempted before its
prompt is done, it drops what it has and scores the prompt again from the start.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate, chain

import torch

from conveyor.engine.scheduled_chunk import ChunkPromptLogprobs, ScheduledChunk
from conveyor.engine.sequence import Sequence

ComputeLogits = Callable[[torch.Tensor], torch.Tensor]  # hidden [n, H] -> logits [n, V] fp32


def chunk_prompt_targets(seq: Sequence, start: int, end: int) -> list[int]:
    """The prompt tokens that positions start, start + 1, .. of seq's chunk [start, end) predict; [] when
    seq collects no prompt logprobs. The last prompt position predicts an output token: it is not scored."""
    if not seq.needs_prompt_logprobs:
        return []
    assert seq.prompt_logprobs is not None and len(seq.prompt_logprobs) == start + 1, (seq.request_id, start)
    return seq.prompt_token_ids[start + 1 : end + 1]


def reset_prompt_logprobs(seq: Sequence) -> None:
    """Preempted before its prompt logprobs are complete: they are scored again with the recomputed prompt
    (complete ones are kept, and never scored again)."""
    if seq.needs_prompt_logprobs:
        seq.prompt_logprobs = [None]


def score_prompt_chunks(
    compute_logits: ComputeLogits, hidden: torch.Tensor, chunks: list[ScheduledChunk], rows_per_slice: int
) -> list[ChunkPromptLogprobs | None]:
    """Each chunk's prompt logprobs (None where it asks for none). hidden [T, H]: the step's hidden states,
    the chunks' tokens in order. At most rows_per_slice rows of logits [rows, V] exist at a time."""
    result: list[ChunkPromptLogprobs | None] = [None] * len(chunks)
    wanted = [i for i, c in enumerate(chunks) if c.prompt_logprobs is not None and c.prompt_targets]
    if not wanted:
        return result
    starts = list(accumulate((len(c.token_ids) for c in chunks), initial=0))
    row_ids = chain.from_iterable(range(starts[i], starts[i] + len(chunks[i].prompt_targets)) for i in wanted)
    rows = torch.tensor(list(row_ids), dtype=torch.int64, device=hidden.device)  # [P]
    targets = torch.tensor(list(chain.from_iterable(chunks[i].prompt_targets for i in wanted)))  # [P] int64
    k = max(chunks[i].prompt_logprobs or 0 for i in wanted)
    token_lp, top_lp, top_ids = _score_rows(compute_logits, hidden, rows, targets, k, rows_per_slice)
    offset = 0
    for i in wanted:
        end, k_i = offset + len(chunks[i].prompt_targets), chunks[i].prompt_logprobs
        result[i] = ChunkPromptLogprobs(targets[offset:end], token_lp[offset:end], top_ids[offset:end, :k_i],
                                        top_lp[offset:end, :k_i])
        offset = end
    return result


def _score_rows(
    compute_logits: ComputeLogits, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, k: int,
    rows_per_slice: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """On the CPU: the logprobs of targets at hidden[rows] [P] fp32, and the top-k logprobs [P, k] fp32 and
    ids [P, k] int64 there."""
    device_targets = targets.to(hidden.device, non_blocking=True)
    token_lp, top_lp, top_ids = [], [], []
    for lo in range(0, rows.shape[0], rows_per_slice):
        hi = lo + rows_per_slice
        logprobs = compute_logits(hidden[rows[lo:hi]]).float().log_softmax(dim=-1)  # [r, V]
        token_lp.append(logprobs.gather(1, device_targets[lo:hi, None])[:, 0])  # [r]
        values, ids = logprobs.topk(k, dim=-1)  # [r, k]
        top_lp.append(values)
        top_ids.append(ids)
    return torch.cat(token_lp).cpu(), torch.cat(top_lp).cpu(), torch.cat(top_ids).cpu()
