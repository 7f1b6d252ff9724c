"""The C++ CPU kernels, built once per machine: paged decode attention, cache writes, fused element-wise ops.

`csrc/paged_decode_cpu.cpp` (decode attention straight from the paged cache), `csrc/cache_write_cpu.cpp`
(a step's K/V rows into their slots) and `csrc/fused_cpu.cpp` (RMSNorm, rotate-half RoPE, SwiGLU in one pass
each) make one extension (`csrc/bindings_cpu.cpp` binds them). It is compiled on first use with torch's C++
extension builder (the system's C++ compiler and ninja), for the instruction set torch detected on this CPU,
and cached by torch under its extensions directory; a later process loads it in milliseconds. `cpu_kernels()`
says whether it could be built, and why not.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(CSRC / name for name in ("paged_decode_cpu.cpp", "cache_write_cpu.cpp", "fused_cpu.cpp",
                                          "bindings_cpu.cpp"))
# Compiler flags per instruction set torch reports (torch.backends.cpu.get_cpu_capability()). Without AVX2 the
# portable build measured 2x slower than the gather path, so no kernel is built there. -ffast-math lets the
# compiler call glibc's vector exp (libmvec); it is a compile flag only, so the process' float mode (which
# -ffast-math at link time would set to flush denormals) is left alone.
# CONVEYOR_VECTOR_BYTES: the decode kernel's vector width (16 floats under AVX-512 measured 1.15x faster than
# 8); head_dim must be a multiple of that many floats (the extension's `lanes`), else decodes use the gather
# path.
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mavx2", "-mfma",
               "-DCONVEYOR_VECTOR_BYTES=64"],
    "AVX2": ["-mavx2", "-mfma", "-DCONVEYOR_VECTOR_BYTES=32"],
}
COMMON_FLAGS = ["-O3", "-fopenmp", "-ffast-math"]


@dataclass(frozen=True)
class CpuKernels:
    """The outcome of building the extension: the loaded module, or None and the reason."""

    module: ModuleType | None
    detail: str  # where and how it was built, or why it could not be


@functools.cache
def cpu_kernels() -> CpuKernels:
    """Builds (or loads from torch's cache) the extension once per process, and logs the outcome."""
    kernels = build_cpu_kernels(torch.backends.cpu.get_cpu_capability())
    if kernels.module is None:
        log.warning("CPU kernels (paged decode attention, fused RMSNorm/RoPE/SwiGLU) are unavailable (%s); "
                    "using the gather path and eager ops (attention backend torch)", kernels.detail)
    else:
        log.info("CPU kernels (paged decode attention, fused RMSNorm/RoPE/SwiGLU) ready (%s)", kernels.detail)
    return kernels


def build_cpu_kernels(isa: str, sources: tuple[Path, ...] = SOURCES) -> CpuKernels:
    """Compiles `sources` for `isa` (a torch CPU capability name); never raises: a failure is the result."""
    if isa not in ISA_FLAGS:
        return CpuKernels(None, f"CPU capability {isa}: the kernels need AVX2 or AVX-512")
    from torch.utils import cpp_extension  # imports setuptools: only when a build is wanted

    started = time.perf_counter()
    try:
        module = cpp_extension.load(name=f"conveyor_cpu_kernels_{isa.lower()}",
                                    sources=[str(source) for source in sources],
                                    extra_cflags=COMMON_FLAGS + ISA_FLAGS[isa], extra_ldflags=["-fopenmp"])
    except Exception as exc:  # no compiler, no ninja, a failed compile or load: all mean "fall back"
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return CpuKernels(None, f"{type(exc).__name__}: {first_line}")
    return CpuKernels(module, f"{isa} build, {time.perf_counter() - started:.1f} s to build or load")
