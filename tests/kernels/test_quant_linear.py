"""Weight-only int8/int4: the quantizers' layouts and error bounds, GGUF's Q8_0 and Q4_1 blocks coming back
exactly, and every kernel (the C++ CPU one, both of its paths; Triton under the interpreter) against the
dequantize-then-multiply reference."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels.cpu_extension import CpuKernels
from conveyor.kernels.quant_linear import GEMM_FROM_ROWS_MAX, quant_linear
from conveyor.kernels.quant_reference import GROUP_SIZE, dequantize, quant_linear_ref, quantize
from conveyor.kernels.triton_quant import quant_matmul_triton

# fp32 sums of up to 96 products in another order than the reference's GEMM.
TOLERANCE = {torch.float32: 2e-4, torch.float16: 2e-2}


def weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits", [8, 4])
def test_each_value_is_within_half_a_step_of_its_group(bits: int) -> None:
    w = weight(40, 96)
    t = quantize(w, bits)
    error = (dequantize(t) - w).abs().reshape(40, -1, GROUP_SIZE)  # [N, K/G, G]
    assert (error <= t.scales[..., None] / 2 + 1e-6).all()
    assert t.shape == (40, 96)
    assert t.nbytes == (40 * 96 if bits == 8 else 40 * 48) + (1 if bits == 8 else 2) * 40 * 3 * 4


def test_gguf_q8_0_and_q4_1_blocks_come_back_exactly() -> None:
    """Q8_0: w = d * q, |q| <= 127 with the largest at 127; Q4_1: w = d * q + m, q in [0, 15] spanning both
    ends. Quantizing such values finds the same d (and m) and the same q."""
    gen = torch.Generator().manual_seed(1)
    d = torch.rand(8, 2, 1, generator=gen) + 0.01
    q8 = torch.randint(-127, 128, (8, 2, GROUP_SIZE), generator=gen)
    q8[..., 0] = 127
    w8 = (d * q8).reshape(8, -1)
    assert torch.equal(dequantize(quantize(w8, 8)), w8)
    q4 = torch.randint(0, 16, (8, 2, GROUP_SIZE), generator=gen)
    q4[..., 0], q4[..., 1] = 0, 15
    m = -torch.rand(8, 2, 1, generator=gen)
    w4 = (d * q4 + m).reshape(8, -1)
    assert (dequantize(quantize(w4, 4)) - w4).abs().max() <= 1e-6


def test_a_weight_laid_out_transposed_quantizes_as_its_contiguous_copy() -> None:
    """The CPU engine keeps expert weights [E, in, out] in memory, viewed as [E, out, in]."""
    w = weight(64, 96).T  # [96, 64], strides (1, 96)
    for bits in (8, 4):
        t, expected = quantize(w, bits), quantize(w.contiguous(), bits)
        assert t.q.is_contiguous() and torch.equal(t.q, expected.q)
        assert torch.equal(dequantize(t), dequantize(expected))


def test_a_constant_group_and_a_bad_width() -> None:
    w = torch.full((2, 32), 0.25)
    assert torch.equal(dequantize(quantize(w, 4)), w)
    assert torch.equal(dequantize(quantize(torch.zeros(2, 32), 8)), torch.zeros(2, 32))
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize(weight(4, 48), 4)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        quantize(weight(4, 32), 2)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 8, 13, 21, GEMM_FROM_ROWS_MAX + 3])
def test_the_cpu_kernel_matches_the_reference(built: CpuKernels, bits: int, rows: int) -> None:
    """Both paths: the register kernel (few rows: in eights, fours and ones) and the tiled GEMM (many)."""
    del built
    t = quantize(weight(70, 96), bits)  # 70 columns: not a multiple of any grain
    x = weight(rows, 96, seed=2)
    bias = weight(1, 70, seed=3)[0]
    got = quant_linear(x, t, bias, "cpu")
    assert (got - quant_linear_ref(x, t, bias)).abs().max() <= TOLERANCE[torch.float32]


def test_the_cpu_path_takes_leading_dims_and_leaves_other_dtypes_to_the_reference(built: CpuKernels) -> None:
    del built
    t = quantize(weight(64, 64), 4)
    x = weight(6, 64, seed=4).reshape(2, 3, 64)
    assert quant_linear(x, t, None, "cpu").shape == (2, 3, 64)
    half = x.half()
    assert torch.equal(quant_linear(half, t, None, "cpu"), quant_linear_ref(half, t))
    with pytest.raises(ValueError, match="backend must be one of"):
        quant_linear(x, t, None, "cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [1, 19])
def test_the_triton_kernel_matches_the_reference(dtype: torch.dtype, bits: int, rows: int) -> None:
    """70 columns and 19 rows: partial tiles on both axes, masked."""
    t = quantize(weight(70, 64), bits)
    x = weight(rows, 64, seed=5).to(dtype)
    got = quant_matmul_triton(x, t)
    assert got.dtype == dtype
    assert (got.float() - quant_linear_ref(x.float(), t)).abs().max() <= TOLERANCE[dtype]
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        quant_matmul_triton(weight(2, 32), t)
