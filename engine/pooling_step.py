"""An embedding engine's step (task "embed", engine/pooling.py) up to its vectors: the scheduled chunks run
for their pooling rows, failures isolated as in a generation step (engine/step_isolation.py); each chunk's
row joins its sequence's, and the sequences whose input is complete get their vectors, computed together."""

from __future__ import annotations

from typing import cast

import torch

from conveyor.engine.pooling import PoolingConfig, accumulate, finish_embeddings
from conveyor.engine.pooling_params import PoolingParams
from conveyor.engine.runner import Runner
from conveyor.engine.scheduled_chunk import RunnerOutput, ScheduledChunk
from conveyor.engine.scheduler import SchedulerOutput
from conveyor.engine.sequence import Sequence
from conveyor.engine.step_isolation import Failures, forward_isolated


def forward_pooled(runner: Runner, sched: SchedulerOutput, vocab_size: int
                   ) -> tuple[dict[Sequence, torch.Tensor], Failures]:
    """The pooling row [H] of each sequence whose chunk ran in a successful forward, and the failures."""
    rows: dict[Sequence, torch.Tensor] = {}
    owners = {id(chunk): seq for chunk, seq in zip(sched.chunks, sched.seqs, strict=True)}

    def execute(chunks: list[ScheduledChunk]) -> RunnerOutput:
        out = runner.execute(chunks)
        if out.pooled is None or out.pooled.shape[0] != len(chunks):
            raise RuntimeError("the model runner returned no pooling row for some chunk")
        rows.update((owners[id(chunk)], row) for chunk, row in zip(chunks, out.pooled, strict=True))
        return out

    _, _, _, failures = forward_isolated(execute, sched, vocab_size, runner.device)
    return rows, failures


def pool_rows(sched: SchedulerOutput, rows: dict[Sequence, torch.Tensor], failures: Failures, method: str
              ) -> list[Sequence]:
    """Joins each surviving chunk's row to its sequence's; returns the sequences whose input is complete."""
    for chunk, seq in zip(sched.chunks, sched.seqs, strict=True):
        if seq not in failures:
            seq.pooled = accumulate(seq.pooled, rows[seq], chunk.start_pos, method)
    return [seq for seq in sched.seqs if seq not in failures and seq.num_uncomputed_tokens == 0]


def embedding_vectors(done: list[Sequence], pooling: PoolingConfig, embedding_size: int | None
                      ) -> list[list[float]]:
    """The vectors of the sequences whose input is complete, each cut and normalised as its params ask."""
    if not done:
        return []
    assert embedding_size is not None and all(s.pooling is not None and s.pooled is not None for s in done)
    params = [cast(PoolingParams, seq.params) for seq in done]
    return finish_embeddings(
        torch.stack([cast(torch.Tensor, seq.pooled) for seq in done]),  # [F, H]
        [seq.num_prompt_tokens for seq in done], pooling.method,
        [p.dimensions or embedding_size for p in params],
        [pooling.normalize if p.normalize is None else p.normalize for p in params],
    )
