"""`python -m conveyor.kernels.prebuild`: builds the C++ CPU kernels ahead of time, where the engine loads
them from.

Run by `make serve`'s setup (this CPU's instruction set) and by the worker image's build (`--isa AVX2 --isa
AVX512`: the image runs on machines other than the one that built it), so that no engine start compiles.
Says what it builds, where, and how long it took; exits 1 if a build failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence

import torch

from conveyor.kernels.cpu_extension import COMPILE_TIME, ISA_FLAGS, build_cpu_kernels, plan_build


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conveyor.kernels.prebuild",
                                     description="Builds the C++ CPU kernels into torch's extensions folder "
                                                 "(TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions).")
    parser.add_argument("--isa", action="append", choices=sorted(ISA_FLAGS),
                        help="an instruction set to build for (repeatable); default: this CPU's")
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)  # see build_elsewhere
    args = parser.parse_args(argv)
    native = torch.backends.cpu.get_cpu_capability()
    isas = args.isa or [native]
    built = [build_here(isa) if isa == native or args.in_process else build_elsewhere(isa) for isa in isas]
    return 0 if all(built) else 1


def build_here(isa: str) -> bool:
    """Builds `isa`'s library and imports it; True when it is ready, or when this CPU takes none."""
    if isa not in ISA_FLAGS:
        print(f"CPU kernels: this CPU ({isa}) has neither AVX2 nor AVX-512, so there is nothing to build "
              "(the engine uses the gather path and eager ops)", flush=True)
        return True
    build = plan_build(isa)
    if not build.is_built():
        print(f"building the CPU kernels for {isa} (C++, once per machine and source change: {COMPILE_TIME}) "
              f"into {build.directory}", flush=True)
    kernels = build_cpu_kernels(isa)
    print(f"CPU kernels: {kernels.detail}" if kernels.module else f"CPU kernels NOT built: {kernels.detail}",
          flush=True)
    return kernels.module is not None


def build_elsewhere(isa: str) -> bool:
    """Builds for an instruction set this CPU may lack, in a child process: once the library is built, the
    child's import of it may die of an illegal instruction, which must not take this process with it."""
    subprocess.run([sys.executable, "-m", "conveyor.kernels.prebuild", "--in-process", "--isa", isa],
                   check=False)
    build = plan_build(isa)
    built = build.is_built()
    print(f"CPU kernels for {isa}: {'built' if built else 'NOT built'} ({build.library})", flush=True)
    return built


if __name__ == "__main__":
    raise SystemExit(main())
