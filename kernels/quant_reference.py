"""Weight-only quantization: the layouts, the quantizers, and the PyTorch reference the kernels are tested
against.

A weight [N, K] (F.linear's layout) is cut along K into groups of GROUP_SIZE (32) values; each group keeps
its own fp32 scale, and an int4 group its own fp32 offset too:

- int8: `q` [N, K] int8, `w = scale * q`, scale = max|w| / 127 (symmetric). GGUF's Q8_0 block is this, so a
  Q8_0 tensor dequantized and quantized again gets its own values back.
- int4: `q` [N, K / 2] uint8, `w = scale * q + min`, q in [0, 15], scale = (max - min) / 15, min the group's
  least value (asymmetric). Byte j of a group's 16 holds q[j] in its low nibble and q[j + 16] in its high
  one, GGUF's order. GGUF's Q4_1 block is `w = d * q + m` with m the block's least value, so it too comes
  back exactly; Q4_0 (`d * (q - 8)`, symmetric) and the K-quants are requantized to the nearest int4 values.

Scales and offsets are fp32 whatever the model's dtype: 8 bytes per 32 int4 weights (0.75 bytes a weight
in all), 4 per 32 int8 ones (1.125).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

GROUP_SIZE = 32


@dataclass(frozen=True)
class QuantizedTensor:
    """A weight [N, K] quantized to `bits` (8 or 4), on one device."""

    q: torch.Tensor  # int8 [N, K] or uint8 [N, K / 2]
    scales: torch.Tensor  # fp32 [N, K / GROUP_SIZE]
    mins: torch.Tensor | None  # fp32 [N, K / GROUP_SIZE] for int4; None for int8
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        rows, width = self.q.shape
        return rows, width if self.bits == 8 else 2 * width

    @property
    def nbytes(self) -> int:
        parts = (self.q, self.scales) if self.mins is None else (self.q, self.scales, self.mins)
        return sum(t.numel() * t.element_size() for t in parts)

    def rows(self, ids: torch.Tensor) -> QuantizedTensor:
        """The rows `ids` [T] (an embedding lookup), still quantized."""
        mins = None if self.mins is None else self.mins[ids]
        return QuantizedTensor(self.q[ids], self.scales[ids], mins, self.bits)


def check_quantizable(weight: torch.Tensor) -> None:
    if weight.dim() != 2 or weight.shape[1] % GROUP_SIZE:
        raise ValueError(f"quantization: a weight must be 2-D with a width divisible by {GROUP_SIZE}, "
                         f"got shape {tuple(weight.shape)}")


def quantize(weight: torch.Tensor, bits: int) -> QuantizedTensor:
    """weight [N, K], any float dtype -> its int8 (bits=8) or int4 (bits=4) groups."""
    check_quantizable(weight)
    groups = weight.float().contiguous().reshape(weight.shape[0], -1, GROUP_SIZE)  # [N, K/G, G]
    if bits == 8:
        scales = groups.abs().amax(dim=-1) / 127  # [N, K/G]
        q = torch.round(groups / _nonzero(scales)[..., None]).clamp(-127, 127).to(torch.int8)
        return QuantizedTensor(q.reshape(weight.shape), scales.contiguous(), None, 8)
    if bits == 4:
        mins, maxs = groups.amin(dim=-1), groups.amax(dim=-1)  # [N, K/G] each
        scales = (maxs - mins) / 15
        q = torch.round((groups - mins[..., None]) / _nonzero(scales)[..., None]).clamp(0, 15).to(torch.uint8)
        half = GROUP_SIZE // 2
        packed = q[..., :half] | (q[..., half:] << 4)  # [N, K/G, G/2]
        return QuantizedTensor(packed.reshape(weight.shape[0], -1), scales.contiguous(), mins.contiguous(), 4)
    raise ValueError(f"quantization: bits must be 8 or 4, got {bits}")


def dequantize(t: QuantizedTensor) -> torch.Tensor:
    """fp32 [N, K]: the weight the quantized values stand for."""
    rows, width = t.shape
    if t.bits == 8:
        groups = t.q.reshape(rows, -1, GROUP_SIZE).float()  # [N, K/G, G]
        return (groups * t.scales[..., None]).reshape(rows, width)
    assert t.mins is not None, "an int4 tensor has offsets"
    packed = t.q.reshape(rows, -1, GROUP_SIZE // 2)  # [N, K/G, G/2]
    q = torch.cat((packed & 0x0F, packed >> 4), dim=-1).float()  # [N, K/G, G]
    return (q * t.scales[..., None] + t.mins[..., None]).reshape(rows, width)


def quant_linear_ref(x: torch.Tensor, t: QuantizedTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize(t)^T (+ bias): [..., N] in x's dtype."""
    bias = None if bias is None else bias.to(x.dtype)
    return F.linear(x, dequantize(t).to(x.dtype), bias)


def _nonzero(scales: torch.Tensor) -> torch.Tensor:
    """An all-equal group has scale 0: divide by 1 instead (its values become q = 0 and the offset)."""
    return torch.where(scales == 0, torch.ones_like(scales), scales)
