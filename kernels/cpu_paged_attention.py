"""The `cpu` backend: a C++ kernel reads decode attention straight from the paged cache; prefill: reference.

The reference gathers every sequence's K/V out of the cache in every layer before SDPA reads it again; for
decode tokens (one query against the whole context) that copy is most of the work. The kernel in
`csrc/paged_decode_cpu.cpp` walks each decode sequence's block table instead and reads every K/V row once
(online softmax, fp32 accumulation), over torch's intra-op threads. Prefill chunks, which are matmul-bound,
still go through the reference's gather and SDPA.

The kernel is compiled on first use with torch's C++ extension builder (the system's C++ compiler and ninja),
for the instruction set torch detected on this CPU, and cached by torch under its extensions directory; a
later process loads it in milliseconds. `decode_kernel()` says whether it could be built, and why not.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType

import torch

from kernels.checks import check_paged_attention
from kernels.metadata import AttentionMetadata
from kernels.reference import AttentionPlan, paged_attention_ref, plan_paged_attention_ref

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode_cpu.cpp"
# Compiler flags per instruction set torch reports (torch.backends.cpu.get_cpu_capability()). Without AVX2 the
# portable build measured 2x slower than the gather path, so no kernel is built there. -ffast-math lets the
# compiler call glibc's vector exp (libmvec); it is a compile flag only, so the process' float mode (which
# -ffast-math at link time would set to flush denormals) is left alone.
# CONVEYOR_VECTOR_BYTES: the kernel's vector width (16 floats under AVX-512 measured 1.15x faster than 8);
# head_dim must be a multiple of that many floats (the extension's `lanes`), else decodes use the gather path.
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mavx2", "-mfma",
               "-DCONVEYOR_VECTOR_BYTES=64"],
    "AVX2": ["-mavx2", "-mfma", "-DCONVEYOR_VECTOR_BYTES=32"],
}
COMMON_FLAGS = ["-O3", "-fopenmp", "-ffast-math"]


@dataclass(frozen=True)
class DecodeKernel:
    """The outcome of building the kernel: the loaded extension, or None and the reason."""

    module: ModuleType | None
    detail: str  # where and how it was built, or why it could not be


@dataclass(frozen=True)
class CpuAttentionPlan:
    """The cpu backend's work for one step: the decodes for the kernel, the rest planned by the reference."""

    decode_rows: torch.Tensor  # [Sd] int64: each decode sequence's row of q and out
    decode_tables: torch.Tensor  # [Sd, max_blocks] int32, contiguous
    decode_seq_lens: torch.Tensor  # [Sd] int32
    rest: AttentionPlan  # the reference's plan for the prefill chunks (and decodes the kernel cannot take)


@functools.cache
def decode_kernel() -> DecodeKernel:
    """Builds (or loads from torch's cache) the kernel once per process, and logs the outcome."""
    kernel = build_decode_kernel(torch.backends.cpu.get_cpu_capability())
    if kernel.module is None:
        log.warning("paged decode attention: the C++ kernel is unavailable (%s); using the gather path "
                    "(attention backend torch)", kernel.detail)
    else:
        log.info("paged decode attention: C++ kernel ready (%s)", kernel.detail)
    return kernel


def build_decode_kernel(isa: str, source: Path = SOURCE) -> DecodeKernel:
    """Compiles `source` for `isa` (a torch CPU capability name); never raises: a failure is the result."""
    if isa not in ISA_FLAGS:
        return DecodeKernel(None, f"CPU capability {isa}: the kernel needs AVX2 or AVX-512")
    from torch.utils import cpp_extension  # imports setuptools: only when a build is wanted

    started = time.perf_counter()
    try:
        module = cpp_extension.load(name=f"conveyor_paged_decode_{isa.lower()}", sources=[str(source)],
                                    extra_cflags=COMMON_FLAGS + ISA_FLAGS[isa], extra_ldflags=["-fopenmp"])
    except Exception as exc:  # no compiler, no ninja, a failed compile or load: all mean "fall back"
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return DecodeKernel(None, f"{type(exc).__name__}: {first_line}")
    return DecodeKernel(module, f"{isa} build, {time.perf_counter() - started:.1f} s to build or load")


def plan_paged_attention_cpu(
    k_cache: torch.Tensor, meta: AttentionMetadata, num_heads: int
) -> CpuAttentionPlan:
    """Decode sequences (query length 1) go to the kernel, unless head_dim is not a multiple of its lanes."""
    module = decode_kernel().module
    assert module is not None, "the cpu backend is resolved only where the kernel builds"
    query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]  # [S]
    kernel_takes = k_cache.shape[3] % module.lanes == 0
    decodes = (query_lens == 1).nonzero().flatten() if kernel_takes else query_lens.new_zeros(0).long()
    rest = plan_paged_attention_ref(k_cache, meta, num_heads, include_decodes=not kernel_takes)
    return CpuAttentionPlan(
        decode_rows=meta.query_start_loc.index_select(0, decodes).long(),
        decode_tables=meta.block_tables.index_select(0, decodes).to(torch.int32).contiguous(),
        decode_seq_lens=meta.seq_lens.index_select(0, decodes).to(torch.int32).contiguous(),
        rest=rest,
    )


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`meta.plan`: from `plan_paged_attention_cpu` on this step's metadata; built here when None."""
    check_paged_attention(q, k_cache, v_cache, meta, out)
    if q.device.type != "cpu":
        raise ValueError(f"backend 'cpu' needs CPU tensors, got q on {q.device}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("backend 'cpu': k_cache and v_cache must be contiguous")
    out = torch.empty_like(q) if out is None else out
    if q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("backend 'cpu': q and out need a contiguous last (head_dim) dimension")
    plan = meta.plan
    if plan is None:
        plan = plan_paged_attention_cpu(k_cache, meta, q.shape[1])
    elif not isinstance(plan, CpuAttentionPlan):
        raise ValueError(f"plan: built for another backend ({type(plan).__name__}), not for 'cpu'")
    if plan.decode_rows.numel():
        module = decode_kernel().module
        assert module is not None, "backend 'cpu' was chosen without a kernel (resolve_backend checks)"
        module.paged_decode(q, k_cache, v_cache, plan.decode_tables, plan.decode_seq_lens, plan.decode_rows,
                            scale, out)
    return paged_attention_ref(q, k_cache, v_cache, replace(meta, plan=plan.rest), scale, out)
