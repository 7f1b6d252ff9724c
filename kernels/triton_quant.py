"""Triton dequantize-and-multiply: out [M, N] = x [M, K] @ dequantize(W)^T for an int8 or int4 weight
(kernels/quant_reference.py has the layouts), the weight expanded tile by tile in registers, never in memory.

Grid (row tile, column tile). The K loop walks one 32-value group per iteration: its scales (and int4
offsets) are one value per output column. An int4 group's 16 bytes hold values j (low nibbles) and j + 16
(high nibbles), so the group is two 16-wide halves: x's first 16 columns meet the low nibbles, its last 16
the high ones, two dots into one fp32 accumulator. fp32 inputs use IEEE dots, fp16/bf16 the tensor cores
(the dequantized tile is cast to x's dtype). Every load and store is masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.kernels.quant_reference import GROUP_SIZE, QuantizedTensor

BLOCK_M = 16
BLOCK_N = 64
HALF = GROUP_SIZE // 2


@triton.jit
def _quant_matmul(x_ptr, q_ptr, scales_ptr, mins_ptr, out_ptr, M, N, K, stride_xm, stride_qn, stride_om,
                  BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr,
                  IEEE: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    offs_j = tl.arange(0, HALF)
    groups = K // (2 * HALF)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, groups):
        k0 = g * 2 * HALF
        x_row = x_ptr + offs_m[:, None] * stride_xm + k0 + offs_j[None, :]  # [BLOCK_M, HALF]
        x_lo = tl.load(x_row, mask=m_ok[:, None], other=0.0)
        x_hi = tl.load(x_row + HALF, mask=m_ok[:, None], other=0.0)
        scale = tl.load(scales_ptr + offs_n * groups + g, mask=n_ok, other=0.0)  # [BLOCK_N]
        if BITS == 8:
            base = q_ptr + offs_n[None, :] * stride_qn + k0 + offs_j[:, None]  # [HALF, BLOCK_N]: W.T halves
            w_lo = tl.load(base, mask=n_ok[None, :], other=0).to(tl.float32) * scale[None, :]
            w_hi = tl.load(base + HALF, mask=n_ok[None, :], other=0).to(tl.float32) * scale[None, :]
        else:
            offset = tl.load(mins_ptr + offs_n * groups + g, mask=n_ok, other=0.0)
            packed = tl.load(q_ptr + offs_n[None, :] * stride_qn + g * HALF + offs_j[:, None],
                             mask=n_ok[None, :], other=0).to(tl.int32)  # [HALF, BLOCK_N]
            w_lo = (packed & 0xF).to(tl.float32) * scale[None, :] + offset[None, :]
            w_hi = (packed >> 4).to(tl.float32) * scale[None, :] + offset[None, :]
        if IEEE:
            acc += tl.dot(x_lo, w_lo, input_precision="ieee")
            acc += tl.dot(x_hi, w_hi, input_precision="ieee")
        else:
            acc += tl.dot(x_lo, w_lo.to(x_lo.dtype))
            acc += tl.dot(x_hi, w_hi.to(x_hi.dtype))
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def quant_matmul_triton(x: torch.Tensor, t: QuantizedTensor) -> torch.Tensor:
    """x [M, K] (unit stride along K) -> [M, N] in x's dtype."""
    n, k = t.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"quantized matmul: x must be [M, {k}], got {tuple(x.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    mins = t.mins if t.mins is not None else t.scales  # unread for int8
    grid = (triton.cdiv(x.shape[0], BLOCK_M), triton.cdiv(n, BLOCK_N))
    _quant_matmul[grid](x, t.q, t.scales, mins, out, x.shape[0], n, k, x.stride(0), t.q.stride(0),
                        out.stride(0), BITS=t.bits, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HALF=HALF,
                        IEEE=x.dtype == torch.float32)
    return out
