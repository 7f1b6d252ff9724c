"""The C++ CPU kernels, built once per machine: paged decode attention, cache writes, fused element-wise ops.

`csrc/paged_decode_cpu.cpp` (decode attention straight from the paged cache), `csrc/cache_write_cpu.cpp`
(a step's K/V rows into their slots) and `csrc/fused_cpu.cpp` (RMSNorm, rotate-half RoPE, SwiGLU in one pass
each) and `csrc/quant_linear_cpu.cpp` (int8/int4 weight-only matrix products) make one extension
(`csrc/bindings_cpu.cpp` binds them), compiled with torch's C++ extension builder
(the system's C++ compiler and ninja) for the instruction set torch detected on this CPU.

Built ahead of time: `python -m conveyor.kernels.prebuild` (run by `make serve`'s setup and by the worker
image's build) compiles it into torch's extensions folder (`TORCH_EXTENSIONS_DIR`, read by torch; default
`~/.cache/torch_extensions/<python>_<accelerator>`). Each build has its own folder, named by a hash of what
makes the binary (the sources and headers, the flags, torch's and Python's versions), so a process that finds
its library there imports it in milliseconds, without ninja or torch's build lock (the folder may be
read-only), and nothing else (another checkout, a test's broken source) can overwrite it. Only when the
library is missing does a process compile, after a log line saying so. `cpu_kernels()` says whether the
extension could be had, and why not.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(CSRC / name for name in ("paged_decode_cpu.cpp", "cache_write_cpu.cpp", "fused_cpu.cpp",
                                          "quant_linear_cpu.cpp", "bindings_cpu.cpp"))
# Compiler flags per instruction set torch reports (torch.backends.cpu.get_cpu_capability()). Without AVX2 the
# portable build measured 2x slower than the gather path, so no kernel is built there. -ffast-math lets the
# compiler call glibc's vector exp (libmvec); it is a compile flag only, so the process' float mode (which
# -ffast-math at link time would set to flush denormals) is left alone.
# CONVEYOR_VECTOR_BYTES: the decode kernel's vector width (16 floats under AVX-512 measured 1.15x faster than
# 8); head_dim must be a multiple of that many floats (the extension's `lanes`), else decodes use the gather
# path.
# Tuples: cpp_extension.load appends torch's own flags to the lists it is given, which would change the hash.
ISA_FLAGS = {
    "AVX512": ("-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mavx2", "-mfma",
               "-DCONVEYOR_VECTOR_BYTES=64"),
    "AVX2": ("-mavx2", "-mfma", "-DCONVEYOR_VECTOR_BYTES=32"),
}
COMMON_FLAGS = ("-O3", "-fopenmp", "-ffast-math")
LINK_FLAGS = ("-fopenmp",)
# Measured on 2 cores: 20-40 s quiet, 143-153 s while other work ran.
COMPILE_TIME = "about 30 s quiet, minutes on a busy machine"
# torch's build lock (a file in the build folder) outlives a compile that was killed, and every later compile
# would wait on it forever: one older than this is such a leftover.
STALE_LOCK_S = 600.0


@dataclass(frozen=True)
class CpuKernels:
    """The outcome of building the extension: the loaded module, or None and the reason."""

    module: ModuleType | None
    detail: str  # where and how it was built or loaded, or why it could not be
    compiled: bool = False  # whether getting it ran the compiler (False: loaded a library built before)


@dataclass(frozen=True)
class KernelBuild:
    """One build of the extension: its module name (the library's PyInit_ symbol) and its own folder."""

    isa: str
    name: str  # conveyor_cpu_kernels_<isa>_<hash of the inputs>
    directory: Path

    @property
    def library(self) -> Path:
        return self.directory / f"{self.name}.so"

    def is_built(self) -> bool:
        return self.library.is_file()


@functools.cache
def cpu_kernels() -> CpuKernels:
    """Loads (or, when it was not built ahead, compiles) the extension once per process; logs the outcome."""
    kernels = build_cpu_kernels(torch.backends.cpu.get_cpu_capability())
    if kernels.module is None:
        log.warning("CPU kernels (paged decode attention, fused RMSNorm/RoPE/SwiGLU) are unavailable (%s); "
                    "using the gather path and eager ops (attention backend torch)", kernels.detail)
    else:
        log.info("CPU kernels (paged decode attention, fused RMSNorm/RoPE/SwiGLU) ready (%s)", kernels.detail)
    return kernels


def require_cpu_kernels(what: str) -> ModuleType:
    """The extension's module, for `what` (the ops that need it); a RuntimeError saying why it is missing."""
    kernels = cpu_kernels()
    if kernels.module is None:
        raise RuntimeError(f"{what} need the C++ CPU kernels, which could not be built here "
                           f"({kernels.detail})")
    return kernels.module


def plan_build(isa: str, sources: tuple[Path, ...] = SOURCES, build_root: Path | None = None) -> KernelBuild:
    """Where the build of `sources` for `isa` lives: under `build_root`, else torch's extensions folder."""
    name = f"conveyor_cpu_kernels_{isa.lower()}_{_inputs_hash(isa, sources)}"
    if build_root is not None:
        return KernelBuild(isa, name, build_root / name)
    from torch.utils import cpp_extension  # imports setuptools: only when the extension is wanted

    # NOTE: torch's own rule for the folder (TORCH_EXTENSIONS_DIR, else the user cache), so that a build
    # made ahead and the engine's load agree without Conveyor reading the environment.
    return KernelBuild(isa, name, Path(cpp_extension._get_build_directory(name, verbose=False)))


def build_cpu_kernels(
    isa: str, sources: tuple[Path, ...] = SOURCES, build_root: Path | None = None
) -> CpuKernels:
    """Loads the build of `sources` for `isa` (a torch CPU capability name), compiling it first when it is
    missing; never raises: a failure is the result."""
    if isa not in ISA_FLAGS:
        return CpuKernels(None, f"CPU capability {isa}: the kernels need AVX2 or AVX-512")
    try:
        build = plan_build(isa, sources, build_root)
    except OSError as exc:  # the extensions folder cannot be created
        return CpuKernels(None, f"{type(exc).__name__}: {exc}")
    if build.is_built():
        loaded = _load_built(build)
        if loaded is not None:
            return loaded
    return _compile(build, sources)


def _load_built(build: KernelBuild) -> CpuKernels | None:
    """The library built before, imported; None when it cannot be (a link cut short): it is compiled again."""
    started = time.perf_counter()
    try:
        spec = importlib.util.spec_from_file_location(build.name, build.library)
        assert spec is not None and spec.loader is not None, build.library
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError) as exc:
        log.warning("CPU kernels: %s does not load (%s); compiling it again", build.library, exc)
        build.library.unlink(missing_ok=True)
        return None
    return CpuKernels(module, f"{build.isa} build loaded from {build.directory} in "
                              f"{time.perf_counter() - started:.2f} s")


def _compile(build: KernelBuild, sources: tuple[Path, ...]) -> CpuKernels:
    log.info("compiling the C++ CPU kernels for %s into %s (once per machine and source change: %s; "
             "`python -m conveyor.kernels.prebuild` builds them ahead of time)", build.isa, build.directory,
             COMPILE_TIME)
    from torch.utils import cpp_extension  # imports setuptools: only when a build is wanted

    started = time.perf_counter()
    try:
        build.directory.mkdir(parents=True, exist_ok=True)
        _remove_stale_lock(build.directory)
        module = cpp_extension.load(name=build.name, sources=[str(source) for source in sources],
                                    extra_cflags=[*COMMON_FLAGS, *ISA_FLAGS[build.isa]],
                                    extra_ldflags=list(LINK_FLAGS),
                                    build_directory=str(build.directory))
    except Exception as exc:  # no compiler, no ninja, a failed compile or load: all mean "fall back"
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return CpuKernels(None, f"{type(exc).__name__}: {first_line}")
    return CpuKernels(module, f"{build.isa} build compiled into {build.directory} in "
                              f"{time.perf_counter() - started:.1f} s", compiled=True)


def _remove_stale_lock(directory: Path) -> None:
    lock = directory / "lock"
    try:
        age_s = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age_s > STALE_LOCK_S:
        log.warning("CPU kernels: removing %s, left %.0f s ago by a compile that did not finish", lock, age_s)
        lock.unlink(missing_ok=True)


def _inputs_hash(isa: str, sources: tuple[Path, ...]) -> str:
    """12 hex digits over everything that changes the library: sources, the headers beside them, flags,
    torch's version (its ABI and headers) and Python's."""
    headers = sorted({header for source in sources for header in source.parent.glob("*.h")})
    digest = hashlib.sha256()
    for path in (*sources, *headers):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for part in (*COMMON_FLAGS, *ISA_FLAGS[isa], *LINK_FLAGS, torch.__version__, sys.version):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:12]
