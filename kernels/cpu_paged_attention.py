"""The `cpu` backend: a C++ kernel reads decode attention straight from the paged cache; prefill: reference.
Cache writes are one row copy per token (C++).

"Decode" here is any sequence with at most KERNEL_MAX_QUERY query tokens: a decode token, a speculating
request's token and drafts, a short tail of a prompt. Each of its query tokens is one row of the kernel, with
the keys up to its own position (so the rows are causal among themselves). In the reference each group of
sequences costs a gather and a masked SDPA per layer whatever its size: a few speculating requests among
many decodes added a group or more per layer (measured: suffix drafts on chat at 32 requests, 0.73x plain
decoding's tokens per second through the reference, 1.0x through the kernel).

The reference gathers every sequence's K/V out of the cache in every layer before SDPA reads it again; for
decode tokens (one query against the whole context) that copy is most of the work. The kernel in
`csrc/paged_decode_cpu.cpp` walks each decode sequence's block table instead and reads every K/V row once
(online softmax, fp32 accumulation), over torch's intra-op threads. Prefill chunks, which are matmul-bound,
still go through the reference's gather and SDPA.

Sliding windows and soft-capping: the kernel starts each decode sequence at its window's first key (blocks
before it are never read, nor checked: their table entries may be -1 or stale) and caps the scaled scores
with tanh before the softmax; the prefill chunks get both from the reference.

The kernel is part of the C++ CPU extension (`conveyor.kernels.cpu_extension`), built once per machine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from conveyor.kernels.checks import check_paged_attention, check_reshape_and_cache
from conveyor.kernels.cpu_extension import cpu_kernels
from conveyor.kernels.metadata import AttentionMetadata
from conveyor.kernels.reference import (
    AttentionPlan,
    check_window_softcap,
    paged_attention_ref,
    plan_paged_attention_ref,
    reshape_and_cache_ref,
)

# The longest query the kernel takes: a token and MAX_NUM_TOKENS drafts (engine/speculation/config.py).
KERNEL_MAX_QUERY = 17


@dataclass(frozen=True)
class CpuAttentionPlan:
    """The cpu backend's work for one step: the decodes for the kernel, the rest planned by the reference."""

    decode_rows: torch.Tensor  # [Sd] int64: each kernel query's row of q and out
    decode_tables: torch.Tensor  # [Sd, max_blocks] int32, contiguous: its sequence's table
    decode_seq_lens: torch.Tensor  # [Sd] int32: the keys it sees (its position + 1)
    rest: AttentionPlan  # the reference's plan for the prefill chunks (and decodes the kernel cannot take)
    window: int | None = None  # the sliding window it was built for (rest's too); None: none


def plan_paged_attention_cpu(
    k_cache: torch.Tensor, meta: AttentionMetadata, num_heads: int, *, window: int | None = None
) -> CpuAttentionPlan:
    """Sequences of up to KERNEL_MAX_QUERY query tokens go to the kernel, one row per query token, unless
    head_dim is not a multiple of its lanes. `window`: the sliding window of the layers the plan serves (None:
    none); it serves that window only."""
    check_window_softcap(window, None)
    module = cpu_kernels().module
    assert module is not None, "the cpu backend is resolved only where the kernel builds"
    max_query = KERNEL_MAX_QUERY if k_cache.shape[3] % module.lanes == 0 else 0
    rest = plan_paged_attention_ref(k_cache, meta, num_heads, skip_query_len=max_query, window=window)
    # The per-sequence metadata is tiny: plain lists build the rows cheaply.
    starts, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    rows: list[int] = []
    row_seq_lens: list[int] = []
    row_seqs: list[int] = []
    for s, seq_len in enumerate(seq_lens):
        num_queries = starts[s + 1] - starts[s]
        if num_queries <= max_query:
            rows += range(starts[s], starts[s + 1])
            row_seq_lens += range(seq_len - num_queries + 1, seq_len + 1)
            row_seqs += [s] * num_queries
    seqs = torch.tensor(row_seqs, dtype=torch.int64, device=meta.block_tables.device)
    return CpuAttentionPlan(
        decode_rows=torch.tensor(rows, dtype=torch.int64),
        decode_tables=meta.block_tables.index_select(0, seqs).to(torch.int32).contiguous(),
        decode_seq_lens=torch.tensor(row_seq_lens, dtype=torch.int32),
        rest=rest,
        window=window,
    )


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """`meta.plan`: from `plan_paged_attention_cpu` on this step's metadata for the same `window`; built here
    when None. `window`, `softcap`: as in `conveyor.kernels.paged_attention` (None: none)."""
    check_window_softcap(window, softcap)
    check_paged_attention(q, k_cache, v_cache, meta, out)
    if q.device.type != "cpu":
        raise ValueError(f"backend 'cpu' needs CPU tensors, got q on {q.device}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("backend 'cpu': k_cache and v_cache must be contiguous")
    out = torch.empty_like(q) if out is None else out
    if q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("backend 'cpu': q and out need a contiguous last (head_dim) dimension")
    plan = meta.plan
    if plan is None:
        plan = plan_paged_attention_cpu(k_cache, meta, q.shape[1], window=window)
    elif not isinstance(plan, CpuAttentionPlan):
        raise ValueError(f"plan: built for another backend ({type(plan).__name__}), not for 'cpu'")
    elif plan.window != window:
        raise ValueError(f"plan: built for window {plan.window}, but attention was asked with window "
                         f"{window}: plan once per window")
    if plan.decode_rows.numel():
        module = cpu_kernels().module
        assert module is not None, "backend 'cpu' was chosen without a kernel (resolve_backend checks)"
        # The kernel's "none": window 0, softcap 0.
        module.paged_decode(q, k_cache, v_cache, plan.decode_tables, plan.decode_seq_lens, plan.decode_rows,
                            scale, window or 0, float(softcap or 0.0), out)
    return paged_attention_ref(q, k_cache, v_cache, replace(meta, plan=plan.rest), scale, out, window=window,
                               softcap=softcap)


def reshape_and_cache_cpu(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The reference's contract, one row copy per token (`csrc/cache_write_cpu.cpp`); layouts the copy cannot
    take (a token's heads not contiguous, a dtype conversion, strided caches) go through the reference."""
    check_reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
    module = cpu_kernels().module
    assert module is not None, "backend 'cpu' was chosen without its kernels (resolve_backend checks)"
    rows_ok = all(x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.dtype == k_cache.dtype for x in (k, v))
    if not (rows_ok and k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.is_contiguous()):
        reshape_and_cache_ref(k, v, k_cache, v_cache, slot_mapping)
        return
    try:
        module.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
    except RuntimeError as exc:  # a slot beyond the cache: the reference's contract says ValueError
        raise ValueError(f"slot_mapping: {exc}".splitlines()[0]) from exc
