"""The `cpu` backend's fused element-wise ops (`csrc/fused_cpu.cpp`): RMSNorm, rotate-half RoPE, SwiGLU.

Each is one pass over its tensors where eager PyTorch makes four to six, each into a fresh tensor; the
arithmetic is transformers', in fp32, rounded to the tensors' dtype where transformers rounds.
"""

from __future__ import annotations

from types import ModuleType

import torch

from conveyor.kernels.cpu_extension import require_cpu_kernels


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [T, H] -> [T, H]
    return _module().rms_norm(x, weight, eps)


def rotate_half_cpu_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] in place (any token and head strides): x * cos + rotate_half(x) * sin; cos, sin [T, D]."""
    _module().rotate_half_(x, cos, sin)
    return x


def silu_and_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] = [gate | up] -> [T, I]
    return _module().silu_and_mul(gate_up)


def _module() -> ModuleType:
    return require_cpu_kernels("the fused CPU ops")
