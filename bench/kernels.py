"""GPU check for the Triton paged attention: correctness at realistic shapes, speed against the device's peak
and against SDPA over the same data laid out contiguously.

    python -m conveyor.bench.kernels              # needs CUDA; prints a message and exits 0 without it
    python -m conveyor.bench.kernels --cpu-smoke  # tiny fp32 shapes through the Triton interpreter on the CPU
    python -m conveyor.bench.kernels --json k.json  # also each case's figures as JSON (for scripts)

Exit status 1 when any case disagrees with the PyTorch reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from conveyor.kernels.metadata import AttentionMetadata

# (name substring, bf16 dense TFLOP/s, memory TB/s); the first match wins, so specific names come first.
PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H200", 989.0, 4.8),
    ("H100 PCIe", 756.0, 2.0),
    ("H100", 989.0, 3.35),
    ("A100-SXM4-80GB", 312.0, 2.039),
    ("A100-PCIE-40GB", 312.0, 1.555),
    ("A100", 312.0, 1.935),
    ("L40S", 362.0, 0.864),
    ("L4", 121.0, 0.3),
    ("A10G", 70.0, 0.6),
)


@dataclass(frozen=True)
class Case:
    name: str
    query_lens: list[int]
    seq_lens: list[int]
    num_splits: int | None = None  # None: the kernel's heuristic


@dataclass(frozen=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    atol: float  # a case passes when |triton - reference| <= atol + rtol * |reference| everywhere
    rtol: float


# The shapes the two runs use: a Llama-3-8B-like layer in bf16 on CUDA; a tiny fp32 one in the interpreter.
GPU_SHAPE = Shape(
    num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16, atol=1e-2, rtol=1e-2
)
CPU_SMOKE_SHAPE = Shape(
    num_heads=8, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, atol=2e-5, rtol=0.0
)


def gpu_cases() -> list[Case]:
    decode = [(1, 32768), (8, 32768), (64, 4096), (256, 1024), (256, 4096)]
    cases = [Case(f"decode b={b} ctx={c // 1024}k", [1] * b, [c] * b) for b, c in decode]
    cases.append(Case("prefill b=1 q=4k", [4096], [4096]))
    cases.append(Case("chunked prefill b=4 q=2k ctx=8k", [2048] * 4, [8192] * 4))
    cases.append(Case("mixed 2k@16k + 2x512@2k + 125 dec@4k",
                      [2048, 512, 512] + [1] * 125, [16384, 2048, 2048] + [4096] * 125))
    return cases


def cpu_smoke_cases() -> list[Case]:
    return [
        Case("decode b=3", [1, 1, 1], [40, 70, 100]),
        Case("prefill b=1 q=48", [48], [48]),
        Case("mixed chunk + decodes", [20, 1, 1], [60, 33, 90]),
        Case("decode b=2 split=3 (forced)", [1, 1], [90, 50], num_splits=3),
    ]


@dataclass
class KernelInputs:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    meta: AttentionMetadata  # block tables of shuffled physical blocks, int32 index tensors
    case: Case
    scale: float

    def args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float]:
        return (self.q, self.k_cache, self.v_cache, self.meta, self.scale)


def build_inputs(case: Case, shape: Shape, device: torch.device, seed: int = 0) -> KernelInputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    bs = shape.block_size
    blocks_per_seq = [-(-n // bs) for n in case.seq_lens]
    num_blocks = sum(blocks_per_seq)
    physical = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    block_table = torch.zeros(len(case.seq_lens), max(blocks_per_seq), dtype=torch.int32, device=device)
    first = 0
    for s, count in enumerate(blocks_per_seq):
        block_table[s, :count] = physical[first:first + count]
        first += count
    cache_shape = (num_blocks, bs, shape.num_kv_heads, shape.head_dim)
    starts = [0]
    for n in case.query_lens:
        starts.append(starts[-1] + n)

    table = block_table.tolist()
    slots = [table[s][pos // bs] * bs + pos % bs
             for s, (query_len, seq_len) in enumerate(zip(case.query_lens, case.seq_lens, strict=True))
             for pos in range(seq_len - query_len, seq_len)]  # [T]: each sequence's last tokens

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=device, dtype=shape.dtype)

    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=block_table,
        seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        max_query_len=max(case.query_lens),
        max_seq_len=max(case.seq_lens),
    )
    return KernelInputs(
        q=randn(starts[-1], shape.num_heads, shape.head_dim),
        k_cache=randn(*cache_shape),
        v_cache=randn(*cache_shape),
        meta=meta,
        case=case,
        scale=shape.head_dim ** -0.5,
    )


def attention_flops(case: Case, shape: Shape) -> float:
    """QK^T and PV over the keys each query actually sees (causal), 2 flops per multiply-add."""
    pairs = zip(case.query_lens, case.seq_lens, strict=True)
    keys_seen = sum(q * (s - q) + q * (q + 1) // 2 for q, s in pairs)  # context keys + causal triangle
    return 4.0 * shape.head_dim * shape.num_heads * keys_seen


def minimal_bytes(case: Case, shape: Shape) -> float:
    """Each cached K/V row read once, q read and the output written once."""
    elem = torch.finfo(shape.dtype).bits // 8
    kv = 2 * sum(case.seq_lens) * shape.num_kv_heads * shape.head_dim
    qo = 2 * sum(case.query_lens) * shape.num_heads * shape.head_dim
    return float((kv + qo) * elem)


def sdpa_over_contiguous(inputs: KernelInputs) -> Callable[[], None]:
    """SDPA on the same data copied out contiguously, one call per run of sequences with equal lengths."""
    runs: dict[tuple[int, int], list[int]] = {}
    for s, (q_len, seq_len) in enumerate(zip(inputs.case.query_lens, inputs.case.seq_lens, strict=True)):
        runs.setdefault((q_len, seq_len), []).append(s)
    calls: list[Callable[[], torch.Tensor]] = []
    bs = inputs.k_cache.shape[1]
    for (q_len, seq_len), seqs in runs.items():
        ids = torch.tensor(seqs, device=inputs.q.device)
        rows = torch.arange(q_len, device=ids.device)
        tokens = (inputs.meta.query_start_loc[ids].long()[:, None] + rows).flatten()  # [B * q_len]
        q = inputs.q[tokens].view(len(seqs), q_len, *inputs.q.shape[1:]).transpose(1, 2).contiguous()
        blocks = inputs.meta.block_tables[ids, : -(-seq_len // bs)].long()
        k = inputs.k_cache[blocks].flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous()  # [B, Hkv, L, D]
        v = inputs.v_cache[blocks].flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous()
        calls.append(_sdpa_call(q, k, v, q_len, seq_len, inputs.scale))

    def run_all() -> None:
        for call in calls:
            call()

    return run_all


def _sdpa_call(q, k, v, q_len: int, seq_len: int, scale: float) -> Callable[[], torch.Tensor]:
    if q_len == 1:
        return lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    if q_len == seq_len:
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    # A chunk after cached context needs a bottom-right causal mask; masked SDPA kernels do not take GQA,
    # so the KV heads are expanded here (outside the timed call).
    positions = torch.arange(seq_len, device=q.device)
    mask = positions[None, :] <= (seq_len - q_len + torch.arange(q_len, device=q.device))[:, None]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> tuple[float, str]:
    """Milliseconds per call and how they were taken: CUDA-graph replays when capture works (no launch
    overhead), else eager calls between CUDA events; wall clock off the GPU."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters, "wall"
    try:
        graph = _capture(fn)
        return _event_ms(graph.replay, iters), "graph"
    except Exception:  # some backend refused capture: time eager launches instead
        torch.cuda.synchronize()
        return _event_ms(fn, iters), "eager"


def _capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # allocations and autotuning happen outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _event_ms(fn: Callable[[], object], iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def device_peaks(device: torch.device) -> tuple[str, float | None, float | None]:
    if device.type != "cuda":
        return "cpu (interpreter)", None, None
    name = torch.cuda.get_device_name(device)
    for key, tflops, tbps in PEAKS:
        if key in name:
            return name, tflops, tbps * 1000.0
    return name, None, None


def run(
    cases: list[Case],
    shape: Shape,
    device: torch.device,
    warmup: int,
    iters: int,
    results: list[dict[str, Any]] | None = None,
) -> bool:
    """True when every case agrees with the reference; each case's figures are appended to `results`."""
    name, peak_tflops, peak_gbps = device_peaks(device)
    console = Console(width=170)
    console.print(f"device: {name}; peaks: {_fmt(peak_tflops, 'TFLOP/s')}, {_fmt(peak_gbps, 'GB/s')}; "
                  f"{shape.dtype}, Hq={shape.num_heads}, Hkv={shape.num_kv_heads}, D={shape.head_dim}, "
                  f"block_size={shape.block_size}; torch {torch.__version__}")
    table = Table("case", "tokens", "splits", "max err", "ok", "triton ms", "TFLOP/s", "GB/s", "SDPA ms",
                  "vs SDPA")
    all_ok = True
    for case in cases:
        row, ok, figures = _bench_case(case, shape, device, warmup, iters, peak_tflops, peak_gbps)
        table.add_row(*row)
        if results is not None:
            results.append(figures)
        all_ok &= ok
    console.print(table)
    console.print("TFLOP/s count causal attention flops; GB/s count each K/V row, q and output once; "
                  "'vs SDPA' > 1 means the paged kernel is faster than SDPA on contiguous copies "
                  "(one call per group of equal lengths; KV heads expanded for chunks after cached context).")
    return all_ok


def _bench_case(
    case: Case, shape: Shape, device: torch.device, warmup: int, iters: int,
    peak_tflops: float | None, peak_gbps: float | None,
) -> tuple[list[str], bool, dict[str, Any]]:
    from conveyor.kernels.reference import paged_attention_ref
    from conveyor.kernels.triton_paged_attention import choose_num_splits, paged_attention_triton

    inputs = build_inputs(case, shape, device)
    args = inputs.args()
    splits = case.num_splits or choose_num_splits(len(case.seq_lens), shape.num_kv_heads,
                                                  max(case.query_lens), max(case.seq_lens), device)
    got = paged_attention_triton(*args, num_splits=splits)
    expected = paged_attention_ref(*args).float()
    diff = (got.float() - expected).abs()
    err = diff.max().item()
    ok = bool((diff <= shape.atol + shape.rtol * expected.abs()).all())
    out = torch.empty_like(inputs.q)
    triton_ms, how = time_ms(lambda: paged_attention_triton(*args, out=out, num_splits=splits),
                             device, warmup, iters)
    sdpa_ms, sdpa_how = time_ms(sdpa_over_contiguous(inputs), device, warmup, iters)
    tflops = attention_flops(case, shape) / triton_ms / 1e9
    gbps = minimal_bytes(case, shape) / triton_ms / 1e6
    row = [case.name, str(sum(case.query_lens)), str(splits), f"{err:.2e}",
           "[green]yes[/]" if ok else "[red]NO[/]", f"{triton_ms:.3f} ({how})",
           _with_share(tflops, peak_tflops), _with_share(gbps, peak_gbps), f"{sdpa_ms:.3f} ({sdpa_how})",
           f"{sdpa_ms / triton_ms:.2f}x"]
    figures = {
        "case": case.name,
        "tokens": sum(case.query_lens),
        "splits": splits,
        "max_err": err,
        "ok": ok,
        "triton_ms": triton_ms,
        "timing": how,
        "tflops": tflops,
        "gbps": gbps,
        "sdpa_ms": sdpa_ms,
        "sdpa_timing": sdpa_how,
    }
    return row, ok, figures


def _with_share(value: float, peak: float | None) -> str:
    return f"{value:.1f}" if peak is None else f"{value:.1f} ({100 * value / peak:.0f}%)"


def _fmt(value: float | None, unit: str) -> str:
    return "unknown" if value is None else f"{value:.0f} {unit}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conveyor.bench.kernels",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="without CUDA: run tiny fp32 cases through the Triton interpreter")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", metavar="PATH", help="also write each case's figures to this JSON file")
    opts = parser.parse_args(argv)
    results: list[dict[str, Any]] = []
    if torch.cuda.is_available():
        ok = run(gpu_cases(), GPU_SHAPE, torch.device("cuda"), warmup=3, iters=opts.iters, results=results)
        _write_json(opts.json, results, ok)
        return 0 if ok else 1
    if not opts.cpu_smoke:
        print("conveyor.bench.kernels: no CUDA device; GPU speed is unmeasured here (use --cpu-smoke for a "
              "tiny interpreter "
              "run).")
        return 0
    os.environ["TRITON_INTERPRET"] = "1"  # before the first import of the Triton kernels
    ok = run(cpu_smoke_cases(), CPU_SMOKE_SHAPE, torch.device("cpu"), warmup=0, iters=1, results=results)
    _write_json(opts.json, results, ok)
    return 0 if ok else 1


def _write_json(path: str | None, results: list[dict[str, Any]], ok: bool) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"ok": ok, "cases": results}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
