"""Pure-PyTorch paged attention and cache writes: the `torch` backend and the oracle for the Triton kernels.

Vectorised in groups of sequences: decodes (query length 1) and prefill chunks are grouped apart, sorted by
context length and cut into groups whose padded working set stays under GROUP_BUDGET_ELEMENTS, so a long
prefill never pads the decodes to its length and a decode batch never pads to its longest context. Each group
gathers its K/V through the block table at block granularity and runs one batched masked SDPA (fp32).
NOTE: the bounded groups also make CPU decoding about 2x faster: allocations of tens of MB are fresh mmaps
whose page faults cost more than the attention itself, while small buffers are reused by the allocator.

Sliding windows (`window`, Hugging Face's convention: the query at position p sees keys k with
`p - window < k <= p`): each sequence gathers from the block holding its first query's first visible key
(blocks wholly before the window are never read: their table entries may be -1 or stale), and the masks add
the window. Soft-capping (`softcap`, Gemma 2: scores become `softcap * tanh(scale * q.k / softcap)` before
masking and softmax) is something SDPA cannot do: such groups run the same attention explicitly (fp32
scores, cap, mask, softmax, matmul), batched per KV head.

The grouping, index tensors and visibility masks depend only on the step's metadata, not on the layer: an
`AttentionPlan` holds them, built once per step (`plan_paged_attention_ref`) and shared by every layer
through the step's `AttentionMetadata.plan`.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from itertools import pairwise

import torch

from conveyor.kernels.checks import check_paged_attention, check_reshape_and_cache
from conveyor.kernels.metadata import AttentionMetadata

GROUP_BUDGET_ELEMENTS = 1 << 21  # fp32 elements of padded K/V, scores and mask per group (8 MiB)


@dataclass(frozen=True)
class GroupPlan:
    """One batched SDPA call: G sequences padded to max_q query rows and max_kv keys."""

    num_seqs: int  # G
    max_q: int
    max_kv: int
    tokens: torch.Tensor  # [Tg] int64: the group's rows of q and out
    # [G * nb] int64: cache blocks to gather, nb = ceil(max_kv / block_size) per sequence, from the block of
    # its first visible key on (block 0 without a window): its keys [offset, offset + max_kv), see the mask
    blocks: torch.Tensor
    padded_rows: torch.Tensor | None  # [Tg] int64: row of each token in the [G * max_q] padded layout
    # Every sequence's chunk starts at position 0 (max_q == max_kv) and no window hides any key: row i sees
    # keys 0..i, SDPA's own causal mode, which skips the key tiles above the diagonal. Same values as the
    # explicit mask, half the work.
    causal: bool
    # [G, 1, max_q, max_kv] bool: gathered key j visible to padded query row i (causal, in the window, before
    # the sequence's end); None when causal or every gathered key is visible to every row
    mask: torch.Tensor | None


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
    window: int | None = None  # the sliding window its blocks and masks were built for; None: none


def plan_paged_attention_ref(
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]: only its shape and device are read
    meta: AttentionMetadata,  # its block_tables, seq_lens, query_start_loc and bounds; not its plan
    num_heads: int,
    skip_query_len: int = 0,
    *,
    window: int | None = None,
) -> AttentionPlan:
    """Sequences with at most `skip_query_len` query tokens are left out (another kernel attends them).
    `window`: the sliding window of the layers the plan serves (None: none); it serves that window only."""
    check_window_softcap(window, None)
    # The per-sequence metadata is tiny: plain lists make the grouping and index building cheap.
    starts, seq_len_list = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    query_lens = [end - begin for begin, end in pairwise(starts)]
    _check_lengths(query_lens, seq_len_list, meta.max_query_len, meta.max_seq_len)
    key_offsets = _key_offsets(query_lens, seq_len_list, window, k_cache.shape[1])
    spans = [seq_len - offset for seq_len, offset in zip(seq_len_list, key_offsets, strict=True)]  # [S]
    row_elements = k_cache.shape[2] * k_cache.shape[3]  # Hkv * D per cached token
    groups = tuple(
        _plan_group(group, starts, query_lens, seq_len_list, key_offsets, meta.block_tables,
                    k_cache.shape[:2], window)
        for group in _group_sequences(query_lens, spans, row_elements, num_heads, skip_query_len)
    )
    most_blocks = max((g.blocks.shape[0] for g in groups), default=0)
    scratch = k_cache.new_empty(2, most_blocks, k_cache.shape[1] * row_elements)
    return AttentionPlan(num_tokens=starts[-1], num_heads=num_heads, cache_shape=tuple(k_cache.shape),
                         groups=groups, scratch=scratch, window=window)


def paged_attention_ref(
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
    """`meta.plan`: from `plan_paged_attention_ref` on this step's metadata for the same `window`; built here
    when None. `window`, `softcap`: see the module docstring (None: none)."""
    check_window_softcap(window, softcap)
    check_paged_attention(q, k_cache, v_cache, meta, out)
    plan = meta.plan
    if plan is None:
        plan = plan_paged_attention_ref(k_cache, meta, q.shape[1], window=window)
    if not isinstance(plan, AttentionPlan):
        raise ValueError(f"plan: built for another backend ({type(plan).__name__}), not for 'torch'")
    _check_plan(plan, q, k_cache, window)
    out = torch.empty_like(q) if out is None else out
    for group in plan.groups:
        _attend_group(q, k_cache, v_cache, group, plan.scratch, scale, softcap, out)
    return out


def check_window_softcap(window: int | None, softcap: float | None) -> None:
    """ValueError naming the argument unless `window` is None or an int >= 1 and `softcap` None or a finite
    number > 0 (every backend's entry points call it)."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, numbers.Integral)
                               or window < 1):
        raise ValueError(f"window must be None or an int >= 1 (keys a query sees, itself included), "
                         f"got {window!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real)
                                or not 0 < softcap < float("inf")):
        raise ValueError(f"softcap must be None or a finite float > 0, got {softcap!r}")


def _check_plan(plan: AttentionPlan, q: torch.Tensor, k_cache: torch.Tensor, window: int | None) -> None:
    if plan.window != window:
        raise ValueError(f"plan: built for window {plan.window}, but attention was asked with window "
                         f"{window}: plan once per window")
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


def _key_offsets(
    query_lens: list[int], seq_lens: list[int], window: int | None, block_size: int
) -> list[int]:
    """[S]: each sequence's first gathered key, the start of the block holding the first key its first query
    sees (0 without a window); blocks before it hold only keys no query of the step sees."""
    if window is None:
        return [0] * len(seq_lens)
    return [max(0, seq_len - query_len - window + 1) // block_size * block_size
            for query_len, seq_len in zip(query_lens, seq_lens, strict=True)]


def _group_sequences(
    query_lens: list[int], seq_lens: list[int], row_elements: int, num_heads: int, skip_query_len: int = 0
) -> list[list[int]]:
    """Sequence ids in groups: decodes apart from prefills, by context length, each padded group bounded.
    `seq_lens`: the keys each sequence gathers (its whole context, or its span from its window's block)."""
    smallest = skip_query_len + 1
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
    key_offsets: list[int],  # [S]: first gathered key (block-aligned), 0 without a window
    block_tables: torch.Tensor,  # [S, max_blocks]
    cache_blocks: tuple[int, int],  # (num_blocks, block_size) of the cache
    window: int | None,
) -> GroupPlan:
    device = block_tables.device
    (num_blocks, block_size), num_seqs = cache_blocks, len(group)
    max_q, max_kv = max(query_lens[s] for s in group), max(seq_lens[s] - key_offsets[s] for s in group)
    tokens = torch.tensor([starts[s] + i for s in group for i in range(query_lens[s])], device=device)  # [Tg]
    used = -(-max_kv // block_size)
    table = block_tables.index_select(0, torch.tensor(group, device=device))  # [G, max_blocks]
    if any(key_offsets[s] for s in group):  # from each sequence's first visible block on
        first = torch.tensor([key_offsets[s] // block_size for s in group], device=device)  # [G]
        columns = (first[:, None] + torch.arange(used, device=device)).clamp_(max=table.shape[1] - 1)
        table = table.gather(1, columns)  # [G, nb]
    # Entries past a sequence's last block may hold anything (padding); their rows are masked out anyway.
    blocks = table[:, :used].long().clamp(0, num_blocks - 1).flatten()  # [G * nb]
    padded_rows = None
    if max_q > 1:  # prefill chunks: every sequence padded to max_q rows
        padded_rows = torch.tensor([j * max_q + i for j, s in enumerate(group) for i in range(query_lens[s])],
                                   device=device)  # [Tg]
    # A shorter sequence's padded rows may then see keys past its end: those rows are dropped anyway.
    causal = (max_q > 1 and all(query_lens[s] == seq_lens[s] for s in group)
              and (window is None or window >= max_q))
    mask = None if causal else _visibility_mask(group, query_lens, seq_lens, max_q, max_kv, device,
                                                window=window, key_offsets=key_offsets)
    return GroupPlan(num_seqs=num_seqs, max_q=max_q, max_kv=max_kv, tokens=tokens, blocks=blocks,
                     padded_rows=padded_rows, causal=causal, mask=mask)


def _attend_group(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    group: GroupPlan,
    scratch: torch.Tensor,  # [2, >= G * nb, block_size * Hkv * D]
    scale: float,
    softcap: float | None,
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

    if softcap is None:
        # SDPA repeats each KV head over its query heads (h -> h // group) without copying K/V.
        o = torch.nn.functional.scaled_dot_product_attention(
            q_pad.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [G, H, Qp|L, D]
            attn_mask=group.mask, is_causal=group.causal, scale=scale, enable_gqa=True,
        )  # [G, Hq, Qp, D]
    else:
        o = _capped_attention(q_pad, k, v, group, scale, softcap)
    o = o.transpose(1, 2).reshape(num_seqs * max_q, num_heads, head_dim)
    if group.padded_rows is not None:
        o = o.index_select(0, group.padded_rows)
    out.index_copy_(0, group.tokens, o.to(out.dtype))


def _capped_attention(
    q_pad: torch.Tensor,  # [G, Qp, Hq, D] fp32
    k: torch.Tensor,  # [G, L, Hkv, D] fp32
    v: torch.Tensor,  # [G, L, Hkv, D] fp32
    group: GroupPlan,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """[G, Hq, Qp, D]: SDPA's result with Gemma 2's soft-capping, scores = softcap * tanh(scale * q.k /
    softcap) before the mask and the softmax (transformers' eager attention order)."""
    num_seqs, max_q, num_heads, head_dim = q_pad.shape
    num_kv_heads, max_kv = k.shape[2], k.shape[1]
    per_kv = num_heads // num_kv_heads  # query head h reads KV head h // per_kv
    # One matmul per (sequence, KV head) over all its query heads' rows: no copy of K/V per query head.
    q_kv = q_pad.permute(0, 2, 1, 3).reshape(num_seqs, num_kv_heads, per_kv * max_q, head_dim)
    scores = torch.matmul(q_kv, k.permute(0, 2, 3, 1))  # [G, Hkv, per_kv * Qp, L]
    scores = scores.mul_(scale / softcap).tanh_().mul_(softcap)
    scores = scores.view(num_seqs, num_kv_heads, per_kv, max_q, max_kv)
    if group.causal:
        visible = torch.ones(max_q, max_kv, dtype=torch.bool, device=q_pad.device).tril_()  # [Qp, L]
    else:
        visible = group.mask[:, :, None] if group.mask is not None else None  # [G, 1, 1, Qp, L]
    if visible is not None:
        scores = scores.masked_fill_(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(num_seqs, num_kv_heads, per_kv * max_q, max_kv)
    o = torch.matmul(probs, v.transpose(1, 2))  # [G, Hkv, per_kv * Qp, D]
    return o.view(num_seqs, num_heads, max_q, head_dim)


def _visibility_mask(
    group: list[int], query_lens: list[int], seq_lens: list[int], max_q: int, max_kv: int,
    device: torch.device, *, window: int | None = None, key_offsets: list[int] | None = None,
) -> torch.Tensor | None:
    """[G, 1, Qp, L] bool: gathered key j (position key_offsets[s] + j) visible to query row i: at or before
    its position, inside its window, before the sequence's end; None when every row sees every key."""
    offsets = [0] * len(seq_lens) if key_offsets is None else key_offsets
    if max_q == 1 and all(seq_lens[s] - offsets[s] == max_kv for s in group) and (
            window is None or all(offsets[s] >= seq_lens[s] - window for s in group)):
        return None  # decodes of equal spans: each sees its whole span
    seq_len = torch.tensor([seq_lens[s] for s in group], device=device)  # [G]
    query_len = torch.tensor([query_lens[s] for s in group], device=device)  # [G]
    # Padded query rows take the position of their sequence's last query: never an all-masked row (no NaN),
    # and their results are dropped anyway.
    rows = torch.minimum(torch.arange(max_q, device=device), query_len[:, None] - 1)  # [G, Qp]
    q_pos = (seq_len - query_len)[:, None] + rows  # [G, Qp]
    k_pos = torch.tensor([offsets[s] for s in group], device=device)[:, None] + torch.arange(max_kv,
                                                                                             device=device)
    k_pos, q_pos = k_pos[:, None, :], q_pos[:, :, None]  # [G, 1, L], [G, Qp, 1]
    allowed = (k_pos <= q_pos) & (k_pos < seq_len[:, None, None])  # [G, Qp, L]
    if window is not None:
        allowed &= k_pos > q_pos - window
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
