"""Pure-PyTorch paged attention and cache writes: the `torch` backend and the oracle for the Triton kernels.

Vectorised in groups of sequences: decodes (query length 1) and prefill chunks are grouped apart, sorted by
context length and cut into groups whose padded working set stays under GROUP_BUDGET_ELEMENTS, so a long
prefill never pads the decodes to its length and a decode batch never pads to its longest context. Each group
gathers its K/V through the block table at block granularity and runs one batched masked SDPA (fp32).
NOTE: the bounded groups also make CPU decoding about 2x faster: allocations of tens of MB are fresh mmaps
whose page faults cost more than the attention itself, while small buffers are reused by the allocator.

The grouping, index tensors and visibility masks depend only on the step's metadata, not on the layer: an
`AttentionPlan` holds them, built once per step (`plan_paged_attention_ref`) and shared by every layer
through the step's `AttentionMetadata.plan`.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch

from kernels.checks import check_paged_attention, check_reshape_and_cache
from kernels.metadata import AttentionMetadata

GROUP_BUDGET_ELEMENTS = 1 << 21  # fp32 elements of padded K/V, scores and mask per group (8 MiB)


@dataclass(frozen=True)
class GroupPlan:
    """One batched SDPA call: G sequences padded to max_q query rows and max_kv keys."""

    num_seqs: int  # G
    max_q: int
    max_kv: int
    tokens: torch.Tensor  # [Tg] int64: the group's rows of q and out
    blocks: torch.Tensor  # [G * nb] int64: cache blocks to gather, nb = ceil(max_kv / block_size) per seq
    padded_rows: torch.Tensor | None  # [Tg] int64: row of each token in the [G * max_q] padded layout
    # Every sequence's chunk starts at position 0 (max_q == max_kv): row i sees keys 0..i, SDPA's own causal
    # mode, which skips the key tiles above the diagonal. Same values as the explicit mask, half the work.
    causal: bool
    mask: torch.Tensor | None  # [G, 1, max_q, max_kv] bool; None when causal or every key is visible


@dataclass(frozen=True)
class AttentionPlan:
    """The torch backend's work for one step, independent of the layer: build once, pass to every layer."""

    num_tokens: int  # T
    num_heads: int  # Hq
    cache_shape: tuple[int, ...]  # [num_blocks, block_size, Hkv, D] of the caches it indexes
    groups: tuple[GroupPlan, ...]
    # [2, largest G * nb, block_size * Hkv * D] in the cache dtype: every group's K and V gather lands here,
    # overwritten by the next group and layer (a fresh multi-MB buffer per gather costs its page faults).
    scratch: torch.Tensor


def plan_paged_attention_ref(
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]: only its shape and device are read
    meta: AttentionMetadata,  # its block_tables, seq_lens, query_start_loc and bounds; not its plan
    num_heads: int,
    include_decodes: bool = True,
) -> AttentionPlan:
    """`include_decodes` False: sequences with one query token are left out (another kernel attends them)."""
    # The per-sequence metadata is tiny: plain lists make the grouping and index building cheap.
    starts, seq_len_list = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    query_lens = [end - begin for begin, end in pairwise(starts)]
    _check_lengths(query_lens, seq_len_list, meta.max_query_len, meta.max_seq_len)
    row_elements = k_cache.shape[2] * k_cache.shape[3]  # Hkv * D per cached token
    groups = tuple(
        _plan_group(group, starts, query_lens, seq_len_list, meta.block_tables, k_cache.shape[:2])
        for group in _group_sequences(query_lens, seq_len_list, row_elements, num_heads, include_decodes)
    )
    most_blocks = max((g.blocks.shape[0] for g in groups), default=0)
    scratch = k_cache.new_empty(2, most_blocks, k_cache.shape[1] * row_elements)
    return AttentionPlan(num_tokens=starts[-1], num_heads=num_heads, cache_shape=tuple(k_cache.shape),
                         groups=groups, scratch=scratch)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`meta.plan`: from `plan_paged_attention_ref` on this step's metadata; built here when None."""
    check_paged_attention(q, k_cache, v_cache, meta, out)
    plan = meta.plan if meta.plan is not None else plan_paged_attention_ref(k_cache, meta, q.shape[1])
    if not isinstance(plan, AttentionPlan):
        raise ValueError(f"plan: built for another backend ({type(plan).__name__}), not for 'torch'")
    _check_plan(plan, q, k_cache)
    out = torch.empty_like(q) if out is None else out
    for group in plan.groups:
        _attend_group(q, k_cache, v_cache, group, plan.scratch, scale, out)
    return out


def _check_plan(plan: AttentionPlan, q: torch.Tensor, k_cache: torch.Tensor) -> None:
    if (plan.num_tokens, plan.num_heads) != tuple(q.shape[:2]) or plan.cache_shape != tuple(k_cache.shape):
        raise ValueError(f"plan: built for {plan.num_tokens} tokens x {plan.num_heads} heads over a cache "
                         f"of shape {plan.cache_shape}, got q {tuple(q.shape)} and k_cache "
                         f"{tuple(k_cache.shape)}")


def _check_lengths(query_lens: list[int], seq_lens: list[int], max_query_len: int, max_seq_len: int) -> None:
    """Value checks the Triton path cannot afford (they need the metadata on the host)."""
    for s, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        if not 0 <= query_len <= min(seq_len, max_query_len):
            raise ValueError(f"query_start_loc: sequence {s} has {query_len} queries, outside "
                             f"[0, min(seq_lens[{s}]={seq_len}, max_query_len={max_query_len})]")
        if seq_len > max_seq_len:
            raise ValueError(f"seq_lens[{s}] = {seq_len} exceeds max_seq_len = {max_seq_len}")


def _group_sequences(
    query_lens: list[int], seq_lens: list[int], row_elements: int, num_heads: int, include_decodes: bool
) -> list[list[int]]:
    """Sequence ids in groups: decodes apart from prefills, by context length, each padded group bounded."""
    smallest = 1 if include_decodes else 2
    order = sorted((s for s in range(len(query_lens)) if query_lens[s] >= smallest),
                   key=lambda s: (query_lens[s] > 1, seq_lens[s]))
    groups: list[list[int]] = []
    max_q = 0
    for s in order:
        group = groups[-1] if groups else []
        same_kind = bool(group) and (query_lens[group[0]] > 1) == (query_lens[s] > 1)
        grown_q = max(max_q, query_lens[s])
        # Per sequence: K and V rows, plus scores and mask per query row (sorted: s has the longest context).
        padded = (len(group) + 1) * seq_lens[s] * (2 * row_elements + 2 * num_heads * grown_q)
        if same_kind and padded <= GROUP_BUDGET_ELEMENTS:
            group.append(s)
            max_q = grown_q
        else:
            groups.append([s])
            max_q = query_lens[s]
    return groups


def _plan_group(
    group: list[int],  # G sequence ids
    starts: list[int],  # [S + 1] query_start_loc
    query_lens: list[int],  # [S]
    seq_lens: list[int],  # [S]
    block_tables: torch.Tensor,  # [S, max_blocks]
    cache_blocks: tuple[int, int],  # (num_blocks, block_size) of the cache
) -> GroupPlan:
    device = block_tables.device
    (num_blocks, block_size), num_seqs = cache_blocks, len(group)
    max_q, max_kv = max(query_lens[s] for s in group), max(seq_lens[s] for s in group)
    tokens = torch.tensor([starts[s] + i for s in group for i in range(query_lens[s])], device=device)  # [Tg]
    used = -(-max_kv // block_size)
    table = block_tables.index_select(0, torch.tensor(group, device=device))  # [G, max_blocks]
    # Entries past a sequence's last block may hold anything (padding); their rows are masked out anyway.
    blocks = table[:, :used].long().clamp(0, num_blocks - 1).flatten()  # [G * nb]
    padded_rows = None
    if max_q > 1:  # prefill chunks: every sequence padded to max_q rows
        padded_rows = torch.tensor([j * max_q + i for j, s in enumerate(group) for i in range(query_lens[s])],
                                   device=device)  # [Tg]
    # A shorter sequence's padded rows may then see keys past its end: those rows are dropped anyway.
    causal = max_q > 1 and all(query_lens[s] == seq_lens[s] for s in group)
    mask = None if causal else _visibility_mask(group, query_lens, seq_lens, max_q, max_kv, device)
    return GroupPlan(num_seqs=num_seqs, max_q=max_q, max_kv=max_kv, tokens=tokens, blocks=blocks,
                     padded_rows=padded_rows, causal=causal, mask=mask)


def _attend_group(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    group: GroupPlan,
    scratch: torch.Tensor,  # [2, >= G * nb, block_size * Hkv * D]
    scale: float,
    out: torch.Tensor,  # [T, Hq, D], written at this group's tokens
) -> None:
    (_, num_heads, head_dim), num_seqs, max_q = q.shape, group.num_seqs, group.max_q
    k = _gather_contiguous(k_cache, group, scratch[0])  # [G, L, Hkv, D] fp32
    v = _gather_contiguous(v_cache, group, scratch[1])

    q_rows = q.index_select(0, group.tokens).float()  # [Tg, Hq, D]
    if group.padded_rows is not None:
        q_rows = q_rows.new_zeros(num_seqs * max_q, num_heads, head_dim).index_copy_(0, group.padded_rows,
                                                                                     q_rows)
    q_pad = q_rows.view(num_seqs, max_q, num_heads, head_dim)

    # SDPA repeats each KV head over its query heads (h -> h // group) without copying K/V.
    o = torch.nn.functional.scaled_dot_product_attention(
        q_pad.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [G, H, Qp|L, D]
        attn_mask=group.mask, is_causal=group.causal, scale=scale, enable_gqa=True,
    )  # [G, Hq, Qp, D]
    o = o.transpose(1, 2).reshape(num_seqs * max_q, num_heads, head_dim)
    if group.padded_rows is not None:
        o = o.index_select(0, group.padded_rows)
    out.index_copy_(0, group.tokens, o.to(out.dtype))


def _visibility_mask(
    group: list[int], query_lens: list[int], seq_lens: list[int], max_q: int, max_kv: int,
    device: torch.device,
) -> torch.Tensor | None:
    """[G, 1, Qp, L] bool: key j visible to query row i; None when every key is visible to every row."""
    if max_q == 1 and all(seq_lens[s] == max_kv for s in group):
        return None  # decodes of equal length: each sees its whole context
    seq_len = torch.tensor([seq_lens[s] for s in group], device=device)  # [G]
    context = seq_len - torch.tensor([query_lens[s] for s in group], device=device)
    q_pos = context[:, None] + torch.arange(max_q, device=device)  # [G, Qp]
    k_pos = torch.arange(max_kv, device=device)  # [L]
    # Padded query rows get q_pos >= seq_len, so they still see every valid key: no all-masked row, no NaN.
    allowed = (k_pos <= q_pos[:, :, None]) & (k_pos < seq_len[:, None, None])  # [G, Qp, L]
    return allowed[:, None]


def _gather_contiguous(cache: torch.Tensor, group: GroupPlan, scratch: torch.Tensor) -> torch.Tensor:
    """[G, max_kv, Hkv, D] fp32: each sequence's first max_kv cache rows, read through its blocks."""
    num_blocks = cache.shape[0]
    rows = scratch[:group.blocks.shape[0]]  # [G * nb, block_size * Hkv * D]
    # index_select over whole blocks: one contiguous copy per block, the cheapest gather on CPU.
    torch.index_select(cache.reshape(num_blocks, -1), 0, group.blocks, out=rows)
    rows = rows.view(group.num_seqs, -1, *cache.shape[2:])[:, :group.max_kv]  # [G, L, Hkv, D]
    return rows.float()


def reshape_and_cache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes k, v [T, Hkv, D] at slot_mapping[t] = block * block_size + offset; skips negative slots."""
    check_reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0  # [T]
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)
