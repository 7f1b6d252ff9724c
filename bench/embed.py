"""The `embed` profile: the engine's embedding throughput against sentence-transformers' `encode`.

Same model folder, device, dtype and thread count, in the same run. A seeded corpus of texts whose lengths
are spread evenly over [min_tokens, max_tokens] tokens goes through `LLM.embed` and through `encode` at each
of several batch sizes; rounds are interleaved (engine, then every batch size, R times) and each system's
best round counts, so a noisy neighbour hurts both alike. The report gives inputs/s and tokens/s, the ratio
of the engine to sentence-transformers' best batch size, and the largest difference between the two
systems' vectors (they must agree: a fast wrong answer is not a result).

It also gives the linear-layer floor: the time the corpus's linear layers alone take at the FLOP/s torch.mm
reaches at the model's own shapes (FLOOR_ROWS rows by each projection's widths), same threads, same run. No
implementation that does those matmuls in the same dtype embeds the corpus faster, so the floor bounds any
ratio to sentence-transformers (which does the same matmuls) from above.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from conveyor.engine.model_source import model_folder

DEFAULT_BATCH_SIZES = (4, 8, 16, 32, 64)
FLOOR_ROWS = 1024  # rows of the floor's matmuls: the engine's token-wise chunk (engine/models/bert.py)
FLOOR_REPEATS = 10  # the best of this many timed matmuls per shape counts


@dataclass(frozen=True)
class EmbedOptions:
    model: str  # a sentence-transformers folder, or preset:NAME
    model_cache: Path
    num_inputs: int = 512
    min_tokens: int = 16
    max_tokens: int = 512
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    rounds: int = 2
    seed: int = 0
    engine: dict[str, Any] | None = None  # EngineConfig fields (--set)

    def check(self) -> None:
        if self.num_inputs < 1:
            raise ValueError(f"num_inputs (-n) must be >= 1, got {self.num_inputs}")
        if not 3 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"embed: need 3 <= min_tokens <= max_tokens, got {self.min_tokens}, "
                             f"{self.max_tokens}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"embed batch sizes must be >= 1, got {self.batch_sizes}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")


@dataclass(frozen=True)
class SystemRun:
    system: str  # "conveyor" or "sentence-transformers"
    batch_size: int | None  # sentence-transformers' encode batch size
    seconds: float  # its best round
    inputs_per_s: float
    tokens_per_s: float


# --- the model and the corpus ---------------------------------------------------------------------------

def build_corpus(folder: Path, opts: EmbedOptions) -> tuple[list[str], int]:
    """Seeded texts whose token counts (special tokens included) are spread evenly over
    [min_tokens, max_tokens]: words drawn from the tokenizer's own whole-word vocabulary, one token each.
    Returns the texts and their tokens in all."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    rng = random.Random(opts.seed)
    words = [w for w in tokenizer.get_vocab() if w.isalnum() and w.islower()]
    if not words:
        raise ValueError(f"{folder}: the tokenizer has no plain lowercase words to build a corpus from")
    specials = len(tokenizer("x")["input_ids"]) - len(tokenizer("x", add_special_tokens=False)["input_ids"])
    texts = []
    for _ in range(opts.num_inputs):
        length = rng.randint(opts.min_tokens, opts.max_tokens) - specials
        texts.append(" ".join(rng.choice(words) for _ in range(max(length, 1))))
    return texts, sum(len(ids) for ids in tokenizer(texts)["input_ids"])


# --- the runs -------------------------------------------------------------------------------------------

def run(opts: EmbedOptions, console: Console, out_dir: Path | None) -> dict[str, Any]:
    opts.check()
    folder = model_folder(opts.model, cache_dir=opts.model_cache)
    texts, total_tokens = build_corpus(folder, opts)
    console.print(f"embed: {len(texts)} inputs of {opts.min_tokens}-{opts.max_tokens} tokens, model "
                  f"{folder}, {torch.get_num_threads()} torch threads", markup=False)
    engine_embed = _engine(folder, opts)
    peer_encode = _peer(folder)
    systems: dict[str, Callable[[], np.ndarray]] = {"conveyor": lambda: engine_embed(texts)}
    systems |= {f"st:{b}": _bound(peer_encode, texts, b) for b in opts.batch_sizes}
    best: dict[str, float] = {}
    vectors: dict[str, np.ndarray] = {}
    for _ in range(opts.rounds):
        for name, embed in systems.items():
            start = time.perf_counter()
            vectors[name] = embed()
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
    runs = [_system_run(name, seconds, len(texts), total_tokens) for name, seconds in best.items()]
    peer_best = max((r for r in runs if r.system != "conveyor"), key=lambda r: r.inputs_per_s)
    ours = next(r for r in runs if r.system == "conveyor")
    diff = float(np.abs(vectors["conveyor"] - vectors[f"st:{peer_best.batch_size}"]).max())
    floor_s = linear_floor_s(folder, total_tokens)
    report = {"options": {**asdict(opts), "model_cache": str(opts.model_cache)}, "model": str(folder),
              "threads": torch.get_num_threads(), "num_tokens": total_tokens,
              "runs": [asdict(r) for r in runs],
              "ratio_to_best_peer": ours.inputs_per_s / peer_best.inputs_per_s,
              "best_peer_batch_size": peer_best.batch_size, "max_abs_diff": diff,
              "linear_floor_s": floor_s, "ratio_bound": peer_best.seconds / floor_s}
    console.print(_table(runs, ours, peer_best, diff))
    console.print(f"linear-layer floor (torch.mm at the model's shapes): {floor_s:.2f} s, so no fp32 "
                  f"implementation exceeds {peer_best.seconds / floor_s:.2f}x the best peer; the engine "
                  f"takes {ours.seconds / floor_s:.2f}x the floor", markup=False)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "embed.json").write_text(json.dumps(report, indent=2))
        console.print(f"report: {out_dir / 'embed.json'}", markup=False)
    return report


def linear_floor_s(folder: Path, num_tokens: int) -> float:
    """Seconds the linear layers of `num_tokens` tokens take at the FLOP/s torch.mm reaches at each of the
    encoder's four projections (qkv, attention output, MLP up, MLP down), in the model's dtype (fp32)."""
    config = json.loads((folder / "config.json").read_text())
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    shapes = [(hidden, 3 * hidden), (hidden, hidden), (hidden, inner), (inner, hidden)]
    seconds_per_row = sum(_mm_seconds(FLOOR_ROWS, k, n) / FLOOR_ROWS for k, n in shapes)
    return seconds_per_row * num_tokens * config["num_hidden_layers"]


def _mm_seconds(rows: int, k: int, n: int) -> float:
    """The best time of [rows, k] @ [k, n]."""
    a, b = torch.randn(rows, k), torch.randn(k, n)
    out = torch.mm(a, b)  # warm up, and the output buffer every timed call reuses
    best = float("inf")
    for _ in range(FLOOR_REPEATS):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return best


def _engine(folder: Path, opts: EmbedOptions) -> Callable[[list[str]], np.ndarray]:
    """The engine's embed call (vectors [N, D] in input order), warmed up."""
    from conveyor.engine.llm import LLM

    config = {"max_num_seqs": 256, "max_num_batched_tokens": 16384, **(opts.engine or {})}
    llm = LLM(str(folder), task="embed", num_threads=torch.get_num_threads(), **config)

    def embed(texts: list[str]) -> np.ndarray:
        outputs = llm.embed(texts)
        return np.asarray([out.embedding for out in outputs], dtype=np.float32)

    embed(["warm up"] * 4)
    return embed


def _peer(folder: Path) -> Callable[[list[str], int], np.ndarray]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")

    def encode(texts: list[str], batch_size: int) -> np.ndarray:
        return model.encode(texts, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True,
                            show_progress_bar=False)

    encode(["warm up"] * 4, 4)
    return encode


def _bound(encode: Callable[[list[str], int], np.ndarray], texts: list[str], batch_size: int
           ) -> Callable[[], np.ndarray]:
    return lambda: encode(texts, batch_size)


def _system_run(name: str, seconds: float, num_inputs: int, num_tokens: int) -> SystemRun:
    system, _, batch = name.partition(":")
    return SystemRun("conveyor" if system == "conveyor" else "sentence-transformers",
                     int(batch) if batch else None, seconds, num_inputs / seconds, num_tokens / seconds)


def _table(runs: list[SystemRun], ours: SystemRun, peer_best: SystemRun, diff: float) -> Table:
    table = Table(title=f"embed: conveyor / best sentence-transformers = "
                        f"{ours.inputs_per_s / peer_best.inputs_per_s:.2f}x (max |diff| {diff:.1e})")
    for column in ("system", "batch size", "best s", "inputs/s", "tokens/s", "vs best peer"):
        table.add_column(column, justify="right")
    for r in runs:
        table.add_row(r.system, str(r.batch_size or "-"), f"{r.seconds:.2f}", f"{r.inputs_per_s:.1f}",
                      f"{r.tokens_per_s:.0f}", f"{r.inputs_per_s / peer_best.inputs_per_s:.2f}x")
    return table
