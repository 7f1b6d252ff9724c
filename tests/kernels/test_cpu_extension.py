"""The C++ CPU extension: it builds here, a failed build is a result, and without it everything falls back."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import kernels
from kernels import cpu_extension
from kernels.cpu_extension import CpuKernels


def test_the_kernels_build_on_this_machine() -> None:
    # CI machines have g++, ninja and AVX2: a failure here means every CPU run falls back to the gather path
    # and eager element-wise ops.
    built = cpu_extension.cpu_kernels()
    assert built.module is not None, built.detail
    assert {"paged_decode", "rms_norm", "rotate_half_", "silu_and_mul"} <= set(dir(built.module))
    assert kernels.resolve_backend(None, torch.device("cpu")) == "cpu"
    assert kernels.resolve_backend("auto", torch.device("cuda")) == "triton"


def test_a_failed_build_is_a_result_with_the_reason(tmp_path: Path) -> None:
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    failed = cpu_extension.build_cpu_kernels("AVX2", sources=(broken,))
    assert failed.module is None and failed.detail
    unsupported = cpu_extension.build_cpu_kernels("DEFAULT")
    assert unsupported.module is None and "AVX2" in unsupported.detail


def test_without_the_kernels_auto_falls_back_and_forcing_cpu_says_why(monkeypatch, caplog) -> None:
    unavailable = CpuKernels(None, "RuntimeError: Ninja is required to load C++ extensions")
    monkeypatch.setattr(cpu_extension, "build_cpu_kernels", lambda isa: unavailable)
    cpu_extension.cpu_kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="kernels.cpu_extension"):
            assert kernels.resolve_backend(None, torch.device("cpu")) == "torch"
        assert "using the gather path and eager ops" in caplog.text and "Ninja is required" in caplog.text
        with pytest.raises(RuntimeError, match=r"attention backend 'cpu'.*Ninja is required"):
            kernels.resolve_backend("cpu", torch.device("cpu"))
        from kernels.cpu_fused import rms_norm_cpu

        with pytest.raises(RuntimeError, match=r"fused CPU ops need the C\+\+ CPU kernels.*Ninja"):
            rms_norm_cpu(torch.ones(2, 4), torch.ones(4), 1e-6)
    finally:
        cpu_extension.cpu_kernels.cache_clear()
