"""One step's attention metadata: the single description of a step that every kernel entry point reads.

S sequences contribute T query tokens to the step, concatenated in `query_start_loc` order. Index tensors
are int32 (int64 accepted) on the device of the step's q and caches; the kernels check shapes, dtypes and
devices, never values on the device (see `conveyor.kernels.checks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the planners import this module: a runtime import would be circular
    from conveyor.kernels.cpu_paged_attention import CpuAttentionPlan
    from conveyor.kernels.reference import AttentionPlan


@dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each sequence attends to.

    `paged_attention` reads every field but `slot_mapping`, `plan_paged_attention` every field but
    `slot_mapping` and `plan`; the cache write (`reshape_and_cache`) takes `slot_mapping` alone.
    """

    slot_mapping: torch.Tensor  # [T]: block_id * block_size + offset of each new token; negative: not written
    # [S, max_blocks]: each sequence's cache blocks. Ignored, so they may be -1 or stale: entries past its
    # last block and, with a sliding window, those of blocks wholly before the window of the sequence's first
    # query this step (no query of the step sees their keys, so the engine may free them early; the Triton and
    # C++ kernels never load them, the reference never gathers them).
    block_tables: torch.Tensor
    seq_lens: torch.Tensor  # [S]: cached tokens per sequence, this step's included
    query_start_loc: torch.Tensor  # [S + 1]: offset of each sequence's first query token in the step
    max_query_len: int  # upper bound of the query lengths (differences of query_start_loc)
    max_seq_len: int  # upper bound of seq_lens
    # The torch or cpu backend's layer-independent work for this step (`plan_paged_attention`), built once and
    # read by every layer's `paged_attention` of the window it was planned for (one plan per window);
    # None: those backends plan on each call, Triton needs none.
    plan: AttentionPlan | CpuAttentionPlan | None = None
