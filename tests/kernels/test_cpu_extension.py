"""The C++ CPU extension: it builds here, ahead of time, into the folder the engine then loads it from; a
failed build is a result, and without it everything falls back."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch

from conveyor.kernels import cpu_extension, prebuild
from conveyor.kernels.cpu_extension import CpuKernels
from conveyor.kernels.paged_attention import resolve_backend

COMPILING = "compiling the C++ CPU kernels"


def test_the_kernels_build_on_this_machine() -> None:
    # CI machines have g++, ninja and AVX2: a failure here means every CPU run falls back to the gather path
    # and eager element-wise ops.
    built = cpu_extension.cpu_kernels()
    assert built.module is not None, built.detail
    assert {"paged_decode", "rms_norm", "rotate_half_", "silu_and_mul"} <= set(dir(built.module))
    assert resolve_backend(None, torch.device("cpu")) == "cpu"
    assert resolve_backend("auto", torch.device("cuda")) == "triton"


def test_a_failed_build_is_a_result_with_the_reason(tmp_path: Path) -> None:
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    failed = cpu_extension.build_cpu_kernels("AVX2", sources=(broken,), build_root=tmp_path / "builds")
    assert failed.module is None and failed.detail
    unsupported = cpu_extension.build_cpu_kernels("DEFAULT")
    assert unsupported.module is None and "AVX2" in unsupported.detail


def test_without_the_kernels_auto_falls_back_and_forcing_cpu_says_why(monkeypatch, caplog) -> None:
    unavailable = CpuKernels(None, "RuntimeError: Ninja is required to load C++ extensions")
    monkeypatch.setattr(cpu_extension, "build_cpu_kernels", lambda isa: unavailable)
    cpu_extension.cpu_kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="conveyor.kernels.cpu_extension"):
            assert resolve_backend(None, torch.device("cpu")) == "torch"
        assert "using the gather path and eager ops" in caplog.text and "Ninja is required" in caplog.text
        with pytest.raises(RuntimeError, match=r"attention backend 'cpu'.*Ninja is required"):
            resolve_backend("cpu", torch.device("cpu"))
        from conveyor.kernels.cpu_fused import rms_norm_cpu

        with pytest.raises(RuntimeError, match=r"fused CPU ops need the C\+\+ CPU kernels.*Ninja"):
            rms_norm_cpu(torch.ones(2, 4), torch.ones(4), 1e-6)
    finally:
        cpu_extension.cpu_kernels.cache_clear()


def test_the_prebuild_is_what_the_engine_then_loads_without_compiling(capsys, caplog) -> None:
    isa = torch.backends.cpu.get_cpu_capability()
    assert prebuild.main([]) == 0
    assert "CPU kernels: " in capsys.readouterr().out
    with caplog.at_level(logging.INFO, logger="conveyor.kernels.cpu_extension"):
        loaded = cpu_extension.build_cpu_kernels(isa)
    assert loaded.module is not None and not loaded.compiled, loaded.detail
    assert "loaded from" in loaded.detail and COMPILING not in caplog.text
    assert cpu_extension.plan_build(isa).library.is_file()


def test_a_missing_build_is_compiled_after_a_line_that_says_so(tmp_path: Path, caplog) -> None:
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    planned = cpu_extension.plan_build("AVX2", sources=(broken,), build_root=tmp_path / "builds")
    with caplog.at_level(logging.INFO, logger="conveyor.kernels.cpu_extension"):
        failed = cpu_extension.build_cpu_kernels("AVX2", sources=(broken,), build_root=tmp_path / "builds")
    assert failed.module is None
    assert cpu_extension.plan_build("AVX2", sources=(broken,), build_root=tmp_path / "builds") == planned
    assert f"{COMPILING} for AVX2 into {tmp_path / 'builds'}" in caplog.text and "about 30 s" in caplog.text


def test_each_build_has_its_own_folder_in_torchs_extensions_dir(tmp_path: Path, monkeypatch) -> None:
    source = tmp_path / "kernel.cpp"
    source.write_text("// one\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    first = cpu_extension.plan_build("AVX2", sources=(source,))
    assert first.directory.parent == tmp_path / "extensions" and first.library.parent == first.directory
    assert cpu_extension.plan_build("AVX2", sources=(source,)) == first  # the same in every process
    assert cpu_extension.plan_build("AVX512", sources=(source,)).name != first.name
    (tmp_path / "kernel.h").write_text("// a header beside it\n")
    with_header = cpu_extension.plan_build("AVX2", sources=(source,))
    source.write_text("// two\n")
    assert len({first.name, with_header.name, cpu_extension.plan_build("AVX2", sources=(source,)).name}) == 3


def test_a_library_that_does_not_load_and_a_stale_lock_do_not_stop_a_compile(tmp_path: Path, caplog) -> None:
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    build = cpu_extension.plan_build("AVX2", sources=(broken,), build_root=tmp_path / "builds")
    build.directory.mkdir(parents=True)
    build.library.write_bytes(b"cut short")
    lock = build.directory / "lock"  # torch's build lock, left by a compile that was killed
    lock.touch()
    old = time.time() - cpu_extension.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    with caplog.at_level(logging.INFO, logger="conveyor.kernels.cpu_extension"):
        failed = cpu_extension.build_cpu_kernels("AVX2", sources=(broken,), build_root=tmp_path / "builds")
    assert failed.module is None and "does not load" in caplog.text and COMPILING in caplog.text
    assert not build.library.exists()  # the compile failed on the source, not on the lock
