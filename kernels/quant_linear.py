"""x @ W^T for a weight kept int8 or int4 (kernels/quant_reference.py has the layouts), one dispatch point.

- `cpu`: the C++ kernels (csrc/quant_linear_cpu.cpp). A step of a few rows (decoding) dequantizes each group
  in registers and multiplies it into every row, reading the weight's bytes once; a step of many rows
  (prefill) is compute-bound, so the weight is expanded to fp32 in row tiles and multiplied by the fp32 GEMM
  (from 32 rows per torch thread, 128 at most).
  fp32 activations only (the CPU engine's dtype); other dtypes take the reference.
- `triton`: a dequantize-and-multiply kernel (kernels/triton_quant.py), on CUDA (or the interpreter).
- `torch`: the reference (dequantize, then F.linear), on any device.
"""

from __future__ import annotations

from types import ModuleType

import torch

from conveyor.kernels.cpu_extension import require_cpu_kernels
from conveyor.kernels.quant_reference import QuantizedTensor, quant_linear_ref

QUANT_BACKENDS = ("cpu", "triton", "torch")
# Rows of x per torch thread from which the CPU path expands the weight and uses the fp32 GEMM, and the most
# it takes: measured on SmolLM2's projections (576 x 960 to 3072 x 576), the register kernel is 1.0-2.2x the
# fp32 GEMM at 8-16 rows and 0.7-0.8x at 32 on one thread, where expanding then the GEMM is 1.0-1.1x; on two
# threads the register kernel still wins at 32 rows (1.1-1.7x) and 64 (0.8-1.0x against 0.7-0.8x), since
# it splits output rows over the threads evenly and the expansion does not.
GEMM_FROM_ROWS_PER_THREAD = 32
GEMM_FROM_ROWS_MAX = 128
TILE_ELEMENTS = 1 << 22  # fp32 values expanded at once on the GEMM path (16 MiB): an LM head in tiles


def quant_linear(x: torch.Tensor, t: QuantizedTensor, bias: torch.Tensor | None, backend: str,
                 ) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype."""
    if backend == "torch" or (backend == "cpu" and x.dtype != torch.float32):
        return quant_linear_ref(x, t, bias)
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    if backend == "cpu":
        out = _cpu(rows, t)
    elif backend == "triton":
        from conveyor.kernels.triton_quant import quant_matmul_triton

        out = quant_matmul_triton(rows, t)
    else:
        raise ValueError(f"quantized linear: backend must be one of {QUANT_BACKENDS}, got {backend!r}")
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def dequantize_rows(t: QuantizedTensor, begin: int, end: int) -> torch.Tensor:
    """fp32 [end - begin, K]: rows of the weight, by the C++ kernel."""
    return _module().quant_dequantize(t.q, t.scales, t.mins, t.bits, begin, end)


def _cpu(x: torch.Tensor, t: QuantizedTensor) -> torch.Tensor:  # [M, K] fp32 -> [M, N]
    if x.shape[0] < min(GEMM_FROM_ROWS_PER_THREAD * torch.get_num_threads(), GEMM_FROM_ROWS_MAX):
        return _module().quant_matmul(x, t.q, t.scales, t.mins, t.bits)
    rows, width = t.shape
    tile = max(1, TILE_ELEMENTS // width)
    parts = [x @ dequantize_rows(t, begin, min(begin + tile, rows)).T for begin in range(0, rows, tile)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _module() -> ModuleType:
    return require_cpu_kernels("the quantized CPU matmuls")
