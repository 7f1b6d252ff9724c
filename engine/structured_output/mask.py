"""Masks a batch's logits to the tokens each constrained request's grammar allows, in one bitmask.

One int32 bitmask [B, ceil(V / 32)] for the batch is filled on the CPU by each constrained row's matcher,
copied to the logits' device once, and applied in place there (disallowed tokens become -inf). Rows without
a matcher are left alone, and a batch without any constrained row skips all of it (and never imports
xgrammar, which only a constrained request needs: engine/structured_output/manager.py). A speculating
request's row j is masked in its grammar's state after its first j drafts (accepted, then rolled back).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from conveyor.engine.speculation.draft_row import DraftRow, SamplingRow

if TYPE_CHECKING:
    import xgrammar


def apply_grammar_masks(logits: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
    """logits [B, V] fp32, one row per seq; returns them masked (a copy if any row is constrained)."""
    rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
    if not rows:
        return logits
    import xgrammar as xgr  # a matcher exists, so xgrammar is installed (and imported already)

    vocab = logits.shape[1]
    bitmask = xgr.allocate_token_bitmask(len(seqs), vocab)  # [B, ceil(V / 32)] int32, all allowed
    for i in rows:
        row = seqs[i]
        _fill_row(row.matcher, row.drafts if isinstance(row, DraftRow) else [], bitmask, i)
    logits = logits.clone()  # the caller's tensor may be reused by a retry in halves
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=vocab, indices=rows)
    return logits


def _fill_row(matcher: xgrammar.GrammarMatcher | None, drafts: list[int], bitmask: torch.Tensor, index: int
              ) -> None:
    """Fills bitmask row `index` with what the grammar allows after `drafts`; the matcher is left as it was.
    (Drafts are cut at the first token the grammar refuses when they are made: engine/speculation/.)"""
    assert matcher is not None
    accepted = 0
    try:
        for token in drafts:
            if not matcher.accept_token(token):
                raise RuntimeError(f"the grammar refused draft token {token} that it accepted when drafted")
            accepted += 1
        matcher.fill_next_token_bitmask(bitmask, index)
    finally:
        if accepted:
            matcher.rollback(accepted)
