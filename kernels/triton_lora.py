"""Triton LoRA deltas for one projection of a step: `out[rows] += (x[rows] @ A[slot].T) @ B[slot].T * scale`,
the rows of each adapter one segment, every adapter of the step in one launch of each of two kernels.

The rows that use an adapter are listed in `rows`, ordered by segment (`seg_starts` [S + 1] cumulative);
segment s reads slot `seg_slots[s]` of the stacked weights A [L, R, K] and B [L, N, R] (L slots, R the
largest rank), its first `seg_ranks[s]` ranks only (0: the adapter does not target this projection: nothing
is added), scaled by `seg_scales[s]`.

- shrink: grid (row tile, segment): u [M, R] fp32 = x[rows] @ A[slot, :rank].T, over K in BLOCK_K steps;
- expand: grid (row tile, column tile, segment): out[rows, col_offset + cols] += u @ B[slot, cols, :rank].T
  * scale. Each output element belongs to one row, so to one segment and one program: no atomics.

A program whose row tile lies past its segment's end exits at once (the host sizes the grid by the longest
segment). Every load and store is masked. fp32 accumulation; the shrink's fp32 inputs use IEEE dots (fp16
and bf16 the tensor cores), the expand runs in fp32 (u is fp32; the rank is small).
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _lora_shrink(x_ptr, a_ptr, u_ptr, rows_ptr, seg_starts_ptr, seg_slots_ptr, seg_ranks_ptr, K,
                 stride_xm, stride_al, stride_ar, stride_um, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    tile, seg = tl.program_id(0), tl.program_id(1)
    start, end = tl.load(seg_starts_ptr + seg), tl.load(seg_starts_ptr + seg + 1)
    first = start + tile * BLOCK_M
    if first < end:
        slot, rank = tl.load(seg_slots_ptr + seg), tl.load(seg_ranks_ptr + seg)
        offs_m = first + tl.arange(0, BLOCK_M)
        row_ok = offs_m < end
        rows = tl.load(rows_ptr + offs_m, mask=row_ok, other=0)
        offs_r = tl.arange(0, BLOCK_R)
        rank_ok = offs_r < rank
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(a_ptr + slot * stride_al + offs_r[None, :] * stride_ar + offs_k[:, None],
                        mask=rank_ok[None, :] & k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_R]: A.T
            if IEEE:
                acc += tl.dot(x, a, input_precision="ieee")
            else:
                acc += tl.dot(x, a)
        tl.store(u_ptr + offs_m[:, None] * stride_um + offs_r[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _lora_expand(u_ptr, b_ptr, out_ptr, rows_ptr, seg_starts_ptr, seg_slots_ptr, seg_ranks_ptr,
                 seg_scales_ptr, N, col_offset, stride_um, stride_bl, stride_bn, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    tile, col_tile, seg = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = tl.load(seg_starts_ptr + seg), tl.load(seg_starts_ptr + seg + 1)
    first = start + tile * BLOCK_M
    rank = tl.load(seg_ranks_ptr + seg)
    if first < end and rank > 0:
        slot, scale = tl.load(seg_slots_ptr + seg), tl.load(seg_scales_ptr + seg)
        offs_m = first + tl.arange(0, BLOCK_M)
        row_ok = offs_m < end
        rows = tl.load(rows_ptr + offs_m, mask=row_ok, other=0)
        offs_r = tl.arange(0, BLOCK_R)
        rank_ok = offs_r < rank
        offs_n = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        u = tl.load(u_ptr + offs_m[:, None] * stride_um + offs_r[None, :],
                    mask=row_ok[:, None] & rank_ok[None, :], other=0.0)
        b = tl.load(b_ptr + slot * stride_bl + offs_n[None, :] * stride_bn + offs_r[:, None],  # B.T tile
                    mask=rank_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_N]
        delta = tl.dot(u, b, input_precision="ieee")  # fp32 both: the rank is small, precision is cheap
        where = out_ptr + rows[:, None] * stride_om + col_offset + offs_n[None, :]
        mask = row_ok[:, None] & n_ok[None, :]
        current = tl.load(where, mask=mask, other=0.0)
        tl.store(where, (current.to(tl.float32) + delta * scale).to(current.dtype), mask=mask)


def lora_delta_triton(x: torch.Tensor, out: torch.Tensor, col_offset: int, a: torch.Tensor, b: torch.Tensor,
                      rows: torch.Tensor, seg_starts: list[int], seg_slots: list[int], seg_ranks: list[int],
                      seg_scales: list[float]) -> None:
    """out[rows[i], col_offset:col_offset + N] += the LoRA delta of x[rows[i]] (see the module docstring).

    x [T, K] and out [T, >= col_offset + N] with unit stride along their last dim; a [L, R, K], b [L, N, R]
    contiguous; rows [M] int64 on x's device; the segment lists on the host (S entries, seg_starts S + 1)."""
    assert x.stride(-1) == 1 and out.stride(-1) == 1 and a.is_contiguous() and b.is_contiguous()
    num_segments = len(seg_slots)
    if num_segments == 0 or not any(seg_ranks):
        return
    device = x.device
    starts = torch.tensor(seg_starts, dtype=torch.int32, device=device)
    slots = torch.tensor(seg_slots, dtype=torch.int32, device=device)
    ranks = torch.tensor(seg_ranks, dtype=torch.int32, device=device)
    scales = torch.tensor(seg_scales, dtype=torch.float32, device=device)
    max_rank, n, k = a.shape[1], b.shape[1], a.shape[2]
    block_r = max(16, triton.next_power_of_2(max_rank))
    u = torch.empty(rows.shape[0], block_r, dtype=torch.float32, device=device)
    longest = max(end - begin for begin, end in itertools.pairwise(seg_starts))
    row_tiles = triton.cdiv(longest, BLOCK_M)
    ieee = x.dtype == torch.float32
    _lora_shrink[(row_tiles, num_segments)](
        x, a, u, rows, starts, slots, ranks, k, x.stride(0), a.stride(0), a.stride(1), u.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=BLOCK_K, IEEE=ieee)
    _lora_expand[(row_tiles, triton.cdiv(n, BLOCK_N), num_segments)](
        u, b, out, rows, starts, slots, ranks, scales, n, col_offset, u.stride(0), b.stride(0), b.stride(1),
        out.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=block_r)
