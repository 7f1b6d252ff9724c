"""One logits row of a speculating request: the request as if its first j drafts were accepted.

The sampler reads a row as it reads a sequence (params, seed generator, grammar, the tokens so far for
penalties and min_tokens), so row j is sampled exactly as plain decoding would sample the token after those
j drafts. Its grammar state is the matcher after the j drafts (engine/structured_output/mask.py accepts them,
fills the row's mask and rolls them back).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.sequence import Sequence

if TYPE_CHECKING:
    import torch
    import xgrammar


@dataclass(frozen=True, eq=False)
class DraftRow:
    seq: Sequence
    drafts: list[int]  # the drafts before this row: its logits score the token after them

    @property
    def params(self) -> SamplingParams:
        assert isinstance(self.seq.params, SamplingParams)
        return self.seq.params

    @property
    def generator(self) -> torch.Generator | None:
        return self.seq.generator

    @property
    def matcher(self) -> xgrammar.GrammarMatcher | None:
        return self.seq.matcher

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.drafts

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + len(self.drafts)

    def all_token_ids(self) -> list[int]:
        return self.seq.all_token_ids() + self.drafts


SamplingRow = Sequence | DraftRow  # what the sampler samples one token for


def owner(row: SamplingRow) -> Sequence:
    return row.seq if isinstance(row, DraftRow) else row


def draft_rows(seqs: list[Sequence]) -> list[SamplingRow]:
    """One row per logits row the runner returned: a sequence without drafts is its own row; one with k
    drafts has k + 1, row j scoring the token after its first j drafts."""
    rows: list[SamplingRow] = []
    for seq in seqs:
        drafts = seq.draft_token_ids
        if drafts:
            rows += [DraftRow(seq, drafts[:j]) for j in range(len(drafts) + 1)]
        else:
            rows.append(seq)
    return rows
