"""Decode attention on CPU: the cpu backend's C++ kernel against the torch backend's gather + SDPA.

    python -m conveyor.bench.cpu_attention             # the shapes of docs/benchmarks/results.md, one thread
    python -m conveyor.bench.cpu_attention --threads 2 --seqs 64 --context 100:1000

One step of S decode sequences (contexts drawn uniformly from --context, seed fixed) over --layers separate
caches, as a model's layers are: each timed call reads every layer once, so the caches are not hot in the
CPU's caches as one layer read over and over would be. The two backends alternate, --rounds times; the
median of each is reported with the K/V bytes it must read (the floor of any implementation). Exit status 1
when the outputs disagree beyond fp32 rounding.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, replace

import torch
from rich.console import Console
from rich.table import Table

from conveyor.kernels.metadata import AttentionMetadata
from conveyor.kernels.paged_attention import paged_attention, plan_paged_attention, resolve_backend

BACKENDS = ("torch", "cpu")


@dataclass(frozen=True)
class DecodeStep:
    q: torch.Tensor  # [S, Hq, D]
    caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K, V [num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata
    context_tokens: int

    def kv_bytes(self) -> int:  # what every layer must read: each sequence's K and V rows, once
        k_cache = self.caches[0][0]
        return 2 * len(self.caches) * self.context_tokens * k_cache[0, 0].numel() * k_cache.element_size()


def build_step(seqs: int, context: tuple[int, int], heads: tuple[int, int], head_dim: int, block_size: int,
               layers: int, seed: int = 0) -> DecodeStep:
    gen = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(context[0], context[1] + 1, (seqs,), generator=gen)
    blocks = (seq_lens + block_size - 1) // block_size  # [S]
    num_blocks = int(blocks.sum())
    # Blocks handed out in order, as the engine's block manager does for fresh prompts.
    table = torch.zeros(seqs, int(blocks.max()), dtype=torch.int32)
    starts = torch.cumsum(blocks, 0) - blocks
    for s in range(seqs):
        table[s, : blocks[s]] = torch.arange(int(starts[s]), int(starts[s] + blocks[s]), dtype=torch.int32)
    shape = (num_blocks, block_size, heads[1], head_dim)
    caches = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(layers)]
    meta = AttentionMetadata(slot_mapping=torch.zeros(seqs, dtype=torch.int64), block_tables=table,
                             seq_lens=seq_lens.to(torch.int32),
                             query_start_loc=torch.arange(seqs + 1, dtype=torch.int32), max_query_len=1,
                             max_seq_len=int(seq_lens.max()))
    q = torch.randn(seqs, heads[0], head_dim, generator=gen)
    return DecodeStep(q=q, caches=caches, meta=meta, context_tokens=int(seq_lens.sum()))


def run_layers(step: DecodeStep, backend: str, out: torch.Tensor) -> None:
    """One step's attention in every layer, the plan built once as the engine does."""
    plan = plan_paged_attention(step.caches[0][0], step.meta, step.q.shape[1], backend=backend)
    meta = replace(step.meta, plan=plan)
    scale = step.q.shape[2] ** -0.5
    for k_cache, v_cache in step.caches:
        paged_attention(step.q, k_cache, v_cache, meta, scale, out, backend=backend)


def time_backends(step: DecodeStep, rounds: int) -> dict[str, list[float]]:
    outs = {b: torch.empty_like(step.q) for b in BACKENDS}
    for backend in BACKENDS:  # warm up: the kernel's first use builds or loads it
        run_layers(step, backend, outs[backend])
    seconds: dict[str, list[float]] = {b: [] for b in BACKENDS}
    for _ in range(rounds):
        for backend in BACKENDS:
            started = time.perf_counter()
            run_layers(step, backend, outs[backend])
            seconds[backend].append(time.perf_counter() - started)
    return seconds


def agree(step: DecodeStep) -> float:
    outs = {b: torch.empty_like(step.q) for b in BACKENDS}
    for backend in BACKENDS:
        run_layers(step, backend, outs[backend])
    return (outs["cpu"] - outs["torch"]).abs().max().item()


def parse_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    bounds = (int(low), int(high or low))
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"expected LOW:HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return bounds


def parse_heads(text: str) -> tuple[int, int]:
    query, _, kv = text.partition(":")
    heads = (int(query), int(kv or query))
    if min(heads) < 1 or heads[0] % heads[1]:
        raise argparse.ArgumentTypeError(f"expected QUERY:KV heads, QUERY a multiple of KV, got {text!r}")
    return heads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conveyor.bench.cpu_attention",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=parse_range, default=(100, 1000), help="LOW:HIGH tokens")
    parser.add_argument("--heads", type=parse_heads, default=(8, 4), help="QUERY:KV heads")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    console = Console()
    if resolve_backend(None, torch.device("cpu")) != "cpu":
        console.print("the C++ decode kernel cannot be built here (the log says why): nothing to compare")
        return 0
    step = build_step(args.seqs, args.context, args.heads, args.head_dim, args.block_size, args.layers)
    error = agree(step)
    seconds = time_backends(step, args.rounds)
    table = Table(title=f"decode attention, {args.seqs} sequences, {step.context_tokens} context tokens, "
                        f"{args.layers} layers, {args.threads} thread(s)")
    for column in ("backend", "median ms", "K/V read GB/s", "vs torch"):
        table.add_column(column)
    torch_ms = statistics.median(seconds["torch"]) * 1e3
    for backend in BACKENDS:
        ms = statistics.median(seconds[backend]) * 1e3
        table.add_row(backend, f"{ms:.2f}", f"{step.kv_bytes() / ms / 1e6:.1f}", f"{torch_ms / ms:.2f}x")
    console.print(table)
    console.print(f"max |cpu - torch| = {error:.2e}")
    return 0 if error <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
