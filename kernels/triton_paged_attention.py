"""Triton paged attention: a step's prefill chunks and decodes in one launch, K/V read via the block table.

Grid: (query tile, KV head, KV split). A query tile holds up to BLOCK_Q query tokens of ONE sequence times
the query heads that share the KV head, so every K/V tile loaded from the cache serves all of them (GQA).
Tiles are numbered without a host sync: sequence s owns tiles starting at `query_start_loc[s] // BLOCK_Q + s`
(enough room for its ceil(query_len / BLOCK_Q) tiles; exactly `query_start_loc[s]` when BLOCK_Q = 1, as in
decode batches); each program finds its sequence by binary search and programs past a sequence's last tile
exit at once.

Split-KV (flash-decoding): with num_splits > 1 (grid axis 2) each program covers one contiguous slice of
the keys visible to its tile and writes a partial result (normalised output + log-sum-exp, fp32); a second
kernel merges the slices by log-sum-exp. `choose_num_splits` uses it for decode batches with too few
(sequence, KV head) programs to fill the GPU; tests force it with `num_splits=`.

Sliding window (WINDOW, Hugging Face's convention: the query at position p sees keys k with
`p - window < k <= p`): a tile's key loop starts at the first key its first row sees, so blocks wholly before
the window are never loaded (their table entries may be -1 or stale), and the visibility mask adds the window
for the later rows; split-KV divides only that visible range. Soft-capping (SOFTCAP, Gemma 2): the
natural-scale score `scale * q.k` becomes `softcap * tanh(scale * q.k / softcap)`, then moves to the log2
domain (tanh as `2 * sigmoid(2x) - 1`, which the interpreter and CUDA both have). Without either flag the
kernel compiles as before.

Any head dim up to 256 (padded to a power of two >= 16 and masked) and any block size work; softmax in fp32
(exp2 with the scale folded into log2(e)); fp32 inputs use IEEE dots, fp16/bf16 use the tensor cores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.kernels.checks import check_paged_attention
from conveyor.kernels.metadata import AttentionMetadata
from conveyor.kernels.reference import check_window_softcap

MAX_HEAD_DIM = 256
MAX_SPLITS = 64
MIN_KEYS_PER_SPLIT = 256
LOG2_E = 1.4426950408889634


@triton.jit
def _first_tile(query_start, seq, BLOCK_Q: tl.constexpr):
    """Index of sequence seq's first query tile (see the module docstring)."""
    if BLOCK_Q == 1:
        return query_start  # one token per tile: the numbering is exact
    else:
        return query_start // BLOCK_Q + seq


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Largest s whose first tile is <= tile."""
    lo = num_seqs * 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = _first_tile(tl.load(query_start_loc_ptr + mid), mid, BLOCK_Q)
        lo = tl.where(first <= tile, mid, lo)
        hi = tl.where(first <= tile, hi, mid - 1)
    return lo


# Integer arguments equal to 1 would otherwise become compile-time constants (and change loop types).
@triton.jit(do_not_specialize=["num_seqs", "num_blocks", "max_blocks", "window"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    num_seqs, num_blocks, max_blocks, scale_log2,
    # Read under WINDOW / SOFTCAP only: cap_in = scale / softcap, cap_out = softcap * log2(e).
    window, cap_in, cap_out,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_os, stride_ot, stride_oh, stride_od,
    stride_ls, stride_lt, stride_lh,
    stride_bts, stride_btb,
    QUERIES_PER_KV: tl.constexpr, GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_row = (tile - _first_tile(q_start, seq, BLOCK_Q)) * BLOCK_Q  # tile's first query in the sequence
    if first_row >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # cached tokens before this step's queries

    # Rows are (query token, query head of this KV head's group), padded to BLOCK_M >= 16 for tl.dot.
    rows = tl.arange(0, BLOCK_M)
    row_query = first_row + rows // GROUP_P2
    row_head = kv_head * QUERIES_PER_KV + rows % GROUP_P2
    row_ok = (rows < BLOCK_Q * GROUP_P2) & (rows % GROUP_P2 < QUERIES_PER_KV) & (row_query < q_len)
    row_pos = context + row_query  # [BLOCK_M] absolute position of each row's query token
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_ok = dims < HEAD_DIM

    q_offs = (q_start + row_query).to(tl.int64)[:, None] * stride_qt + row_head[:, None] * stride_qh
    q = tl.load(q_ptr + q_offs + dims[None, :] * stride_qd, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    kv_end = context + tl.minimum(first_row + BLOCK_Q, q_len)  # keys [kv_start, kv_end): visible to some row
    kv_start = 0
    if WINDOW:  # the tile's first row (position context + first_row) sees the earliest keys
        kv_start = tl.maximum(context + first_row - window + 1, 0)
    kv_lo = kv_start
    kv_hi = kv_end
    if SPLIT:
        per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        kv_lo = kv_start + split * per_split
        kv_hi = tl.minimum(kv_lo + per_split, kv_end)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: exp2(m_i - m_new) never sees -inf - -inf
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], dtype=tl.float32)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] positions
        logical = keys // BLOCK_SIZE
        in_range = (keys < kv_hi) & (logical < max_blocks)
        block = tl.load(block_table_ptr + seq * stride_bts + logical * stride_btb, mask=in_range, other=0)
        key_ok = in_range & (block >= 0) & (block < num_blocks)
        slot_k = block.to(tl.int64) * stride_kb + (keys % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
        slot_v = block.to(tl.int64) * stride_vb + (keys % BLOCK_SIZE) * stride_vt + kv_head * stride_vh
        k = tl.load(k_cache_ptr + slot_k[None, :] + dims[:, None] * stride_kd,
                    mask=key_ok[None, :] & dim_ok[:, None], other=0.0)  # [D, BLOCK_N]
        qk = tl.dot(q, k, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        # Log2 domain; soft-capped: softcap * tanh(scale * qk / softcap) on the natural scale, times log2(e).
        s = (2.0 * tl.sigmoid(2.0 * (qk * cap_in)) - 1.0) * cap_out if SOFTCAP else qk * scale_log2
        visible = key_ok[None, :] & (keys[None, :] <= row_pos[:, None])
        if WINDOW:
            visible = visible & (keys[None, :] > row_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + slot_v[:, None] + dims[None, :] * stride_vd,
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0.0  # false only for padding rows or for a split holding none of the row's keys
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    token = (q_start + row_query).to(tl.int64)
    out_offs = split * stride_os + token[:, None] * stride_ot + row_head[:, None] * stride_oh
    tl.store(out_ptr + out_offs + dims[None, :] * stride_od, o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])
    if SPLIT:
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + split * stride_ls + token * stride_lt + row_head * stride_lh, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr, num_splits,
    stride_ps, stride_pt, stride_ph, stride_pd,
    stride_ls, stride_lt, stride_lh,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, SPLITS_P2: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_P2)
    split_ok = splits < num_splits
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_ok = dims < HEAD_DIM
    lse = tl.load(lse_ptr + splits * stride_ls + token * stride_lt + head * stride_lh,
                  mask=split_ok, other=float("-inf"))  # [SPLITS_P2], log2 domain
    weight = tl.exp2(lse - tl.max(lse, 0))  # empty splits (lse = -inf) weigh 0
    part = tl.load(part_ptr + splits[:, None] * stride_ps + token * stride_pt + head * stride_ph
                   + dims[None, :] * stride_pd, mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    o = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)  # [HEAD_DIM_P2]
    out_offs = token * stride_ot + head * stride_oh + dims * stride_od
    tl.store(out_ptr + out_offs, o.to(out_ptr.dtype.element_ty), mask=dim_ok)


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Same contract as `conveyor.kernels.paged_attention` (`meta.plan` ignored, so any window works without
    a plan); `num_splits` forces the split-KV factor (1 = no split)."""
    check_window_softcap(window, softcap)
    check_paged_attention(q, k_cache, v_cache, meta, out)
    _check_triton_inputs(q, num_splits)
    block_tables, max_query_len = meta.block_tables, meta.max_query_len
    out = torch.empty_like(q) if out is None else out
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, num_kv_heads = block_tables.shape[0], k_cache.shape[2]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_query_len, meta.max_seq_len, q.device,
                                       window=window)

    group = num_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    block_q = 1 if max_query_len <= 1 else max(1, 64 // group_p2)
    block_m = max(16, block_q * group_p2)
    head_dim_p2 = max(16, triton.next_power_of_2(head_dim))
    block_n = 64 if head_dim_p2 <= 128 else 32
    num_tiles = num_tokens if block_q == 1 else num_tokens // block_q + num_seqs
    seq_lens, query_start_loc = meta.seq_lens.contiguous(), meta.query_start_loc.contiguous()

    split = num_splits > 1
    if split:
        part = torch.empty(num_splits, num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_splits, num_tokens, num_heads, dtype=torch.float32, device=q.device)
        target = part
    else:
        lse = torch.empty(1, 1, 1, dtype=torch.float32, device=q.device)  # unused
        target = out.unsqueeze(0)
    _paged_attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        q, k_cache, v_cache, target, lse,
        block_tables, seq_lens, query_start_loc,
        num_seqs, k_cache.shape[0], block_tables.shape[1], scale * LOG2_E,
        window or 0, scale / softcap if softcap else 0.0, softcap * LOG2_E if softcap else 0.0,
        *q.stride(), *k_cache.stride()[:4], *v_cache.stride()[:4], *target.stride(), *lse.stride(),
        *block_tables.stride(),
        QUERIES_PER_KV=group, GROUP_P2=group_p2,
        HEAD_DIM=head_dim, HEAD_DIM_P2=head_dim_p2, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        SPLIT=split, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WINDOW=window is not None, SOFTCAP=softcap is not None,
        num_warps=8 if head_dim_p2 > 128 else 4,
    )
    if split:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part, lse, out, num_splits,
            *part.stride(), *lse.stride(), *out.stride(),
            HEAD_DIM=head_dim, HEAD_DIM_P2=head_dim_p2, SPLITS_P2=triton.next_power_of_2(num_splits),
        )
    return out


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, device: torch.device,
    *, window: int | None = None,
) -> int:
    """Split-KV factor: > 1 only for decode batches whose (sequence, KV head) programs cannot fill the GPU.
    A decode sees at most `window` keys: splits are sized by the keys it sees."""
    if device.type != "cuda" or max_query_len > 1:
        return 1
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    programs = num_seqs * num_kv_heads
    wanted = -(-4 * sm_count // programs)  # about four programs per SM keep the memory system busy
    keys = max_seq_len if window is None else min(max_seq_len, window)
    return max(1, min(wanted, keys // MIN_KEYS_PER_SPLIT, MAX_SPLITS))


def _check_triton_inputs(q: torch.Tensor, num_splits: int | None) -> None:
    head_dim = q.shape[2]
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q head dim must be in [1, {MAX_HEAD_DIM}] for the Triton kernel, got {head_dim}")
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    if q.device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise ValueError(f"q is on {q.device}: the Triton backend needs CUDA tensors, or TRITON_INTERPRET=1 "
                         "set before triton is imported to run on the CPU")
