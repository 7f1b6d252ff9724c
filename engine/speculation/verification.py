"""The engine's side of speculation, after the step's rows are sampled: which tokens each request keeps,
and its state set back to them.

Row j of a request with drafts d_1..d_k was sampled as plain decoding samples the token after d_1..d_j
(draft_row.py). The request keeps row 0's token t_0; while t_j equals d_{j+1} the draft was right, and row
j + 1 was sampled in exactly the state plain decoding reaches, so its token is kept too; the first mismatch
ends the run. Each kept token is therefore the token plain decoding gives (greedy: the argmax; sampled:
a draw from the same distribution with, for a seeded request, the same noise). Drafts without probabilities
are accepted with the target probability of the drafted token, and a rejected position is drawn from the
rest: rejection sampling with a one-token proposal, which keeps the output distribution unchanged.

A seeded request's generator drew noise for all k + 1 rows: it is wound back to just after the rows kept,
so its later tokens are those plain decoding would draw. The blocks taken for rejected drafts are released
and the K/V written there is never registered in the prefix cache: only computed tokens are, and the
rejected positions are beyond them (overwritten by the next step).
"""

from __future__ import annotations

import torch

from conveyor.engine.block_manager import BlockManager
from conveyor.engine.sampler import SamplerOutput
from conveyor.engine.sequence import Sequence
from conveyor.engine.speculation.draft_row import DraftRow, SamplingRow, owner
from conveyor.engine.speculation.speculator import Speculator

TokenLogprobs = dict[int, float] | None


def accepted_runs(rows: list[SamplingRow], sampled: SamplerOutput, failed: set[Sequence]
                  ) -> tuple[list[Sequence], list[list[int]], list[list[TokenLogprobs]]]:
    """Per request not in `failed`, in row order: the tokens it keeps and their logprobs."""
    seqs: list[Sequence] = []
    runs: list[list[int]] = []
    logprobs: list[list[TokenLogprobs]] = []
    still_matching = False  # whether the current request's previous row matched its draft
    for row, token, lp in zip(rows, sampled.token_ids, sampled.logprobs, strict=True):
        seq = owner(row)
        if seq in failed:
            continue
        j = len(row.drafts) if isinstance(row, DraftRow) else 0
        if j == 0:
            seqs.append(seq)
            runs.append([token])
            logprobs.append([lp])
        elif still_matching:
            runs[-1].append(token)
            logprobs[-1].append(lp)
        else:
            continue
        drafts = seq.draft_token_ids
        still_matching = j < len(drafts) and token == drafts[j]
    return seqs, runs, logprobs


def generator_states(seqs: list[Sequence]) -> dict[Sequence, torch.Tensor]:
    """The seeded generators of sampled requests with drafts, before their rows draw noise."""
    return {seq: seq.generator.get_state() for seq in seqs
            if seq.draft_token_ids and seq.generator is not None and not seq.params.greedy}


def rewind_generator(seq: Sequence, state: torch.Tensor, num_rows: int, vocab_size: int,
                     device: torch.device) -> None:
    """Sets seq's generator to after num_rows draws of row noise, as the sampler draws it ([V] fp32)."""
    assert seq.generator is not None
    seq.generator.set_state(state)
    for _ in range(num_rows):
        torch.empty(vocab_size, device=device).exponential_(generator=seq.generator)


def record_drafts(seqs: list[Sequence], runs: list[list[int]], speculator: Speculator) -> None:
    """Each speculating request's verified draft: its run kept len(run) - 1 drafts (before its outputs are
    made, so they count this step)."""
    for seq, run in zip(seqs, runs, strict=True):
        if seq.draft_token_ids:
            speculator.record(seq, len(seq.draft_token_ids), len(run) - 1)


def settle(seq: Sequence, block_manager: BlockManager) -> None:
    """After its tokens were appended, a request that speculated and is still running counts its kept drafts
    as computed (the step wrote their K/V) and releases the blocks past its tokens; the blocks those drafts
    completed join the prefix cache."""
    seq.draft_token_ids = []
    if seq.is_finished:
        return
    # The tokens' K/V up to the last kept draft are right; the newest token's is not computed yet.
    seq.num_computed_tokens = seq.num_tokens - 1
    block_manager.trim(seq)
    block_manager.cache_computed_blocks(seq)
    block_manager.free_outside_window(seq)
