"""The `lora` profile: the engine serving N LoRA adapters mixed uniformly, against the same engine serving the
base model alone and against transformers + PEFT switching adapters per batch.

Same model, requests, dtype, device and thread count, in the same run. The requests are seeded: fixed-length
prompts of random token ids (so the PEFT peer pads nothing) and a fixed number of greedy output tokens each
(EOS ignored), assigned to the adapters in turn. The adapters are random PEFT ones (both halves random, so
they change the output) of rank `rank` on all seven projections, saved by PEFT itself under the model cache.
Rounds are interleaved and each system's best round counts. The peer runs the requests of one adapter after
another (`set_adapter`), in batches of `peft_batch_size` through `generate`, with `peft_adapters` adapters.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class LoraOptions:
    model: Path  # a Llama-shaped Hugging Face folder
    model_cache: Path  # where the random adapters are saved, once per model, rank and seed
    adapter_counts: tuple[int, ...] = (1, 4, 16)
    num_requests: int = 64
    prompt_tokens: int = 64
    max_tokens: int = 32
    rank: int = 16
    peft_adapters: int = 4  # the peer's adapters (it is slow: one count, the one the goal names)
    peft_batch_size: int = 8
    rounds: int = 2
    seed: int = 0
    engine: dict[str, Any] | None = None  # EngineConfig fields (--set)

    def check(self) -> None:
        if not self.adapter_counts or min(self.adapter_counts) < 1:
            raise ValueError(f"lora adapter counts must be >= 1, got {self.adapter_counts}")
        for name in ("num_requests", "prompt_tokens", "max_tokens", "rank", "peft_batch_size", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"lora: {name} must be >= 1, got {getattr(self, name)}")
        if self.peft_adapters not in (0, *self.adapter_counts):
            raise ValueError(f"lora: peft_adapters ({self.peft_adapters}) must be 0 (no peer) or one of the "
                             f"adapter counts {self.adapter_counts}")


@dataclass(frozen=True)
class SystemRun:
    system: str  # "conveyor" or "transformers+peft"
    adapters: int  # 0: the base model alone
    seconds: float  # its best round
    output_tokens_per_s: float


def run(opts: LoraOptions, console: Console, out_dir: Path | None) -> dict[str, Any]:
    opts.check()
    prompts = _prompts(opts)
    adapters = build_adapters(opts.model, opts.model_cache, max(opts.adapter_counts), opts.rank, opts.seed)
    console.print(f"lora: {opts.num_requests} requests of {opts.prompt_tokens} prompt + {opts.max_tokens} "
                  f"output tokens, rank {opts.rank} on {', '.join(ALL_LINEAR)}, model {opts.model}, "
                  f"{torch.get_num_threads()} torch threads", markup=False)
    systems = {("conveyor", count): _engine_run(opts, adapters, prompts, count)
               for count in (0, *opts.adapter_counts)}
    if opts.peft_adapters:
        systems[("transformers+peft", opts.peft_adapters)] = _peft_run(opts, adapters[:opts.peft_adapters],
                                                                       prompts)
    best: dict[tuple[str, int], float] = {}
    for _ in range(opts.rounds):
        for key, system in systems.items():
            start = time.perf_counter()
            system()
            best[key] = min(best.get(key, float("inf")), time.perf_counter() - start)
    tokens = opts.num_requests * opts.max_tokens
    runs = [SystemRun(name, count, seconds, tokens / seconds) for (name, count), seconds in best.items()]
    report = {"options": {**asdict(opts), "model": str(opts.model), "model_cache": str(opts.model_cache)},
              "threads": torch.get_num_threads(), "runs": [asdict(r) for r in runs], **_ratios(runs, opts)}
    console.print(_table(runs, report))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "lora.json").write_text(json.dumps(report, indent=2))
        console.print(f"report: {out_dir / 'lora.json'}", markup=False)
    return report


def build_adapters(model: Path, cache: Path, count: int, rank: int, seed: int) -> list[Path]:
    """`count` random PEFT adapters of `model`, saved once under `cache`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = cache / f"lora-{model.name}-r{rank}-s{seed}"
    paths = [root / f"adapter-{i}" for i in range(count)]
    for i, path in enumerate(paths):
        if (path / "adapter_model.safetensors").exists():
            continue
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ALL_LINEAR, init_lora_weights=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 1000 + i)
            get_peft_model(base, config).save_pretrained(path)
    return paths


def _prompts(opts: LoraOptions) -> list[list[int]]:
    vocab = int(json.loads((opts.model / "config.json").read_text())["vocab_size"])
    rng = random.Random(opts.seed)
    return [[rng.randrange(3, vocab) for _ in range(opts.prompt_tokens)] for _ in range(opts.num_requests)]


def _engine_run(opts: LoraOptions, adapters: list[Path], prompts: list[list[int]], count: int
                ) -> Callable[[], None]:
    """The engine serving `count` adapters in turn over the requests (0: the base model alone); warmed up."""
    from conveyor.engine.llm import LLM
    from conveyor.engine.sampling_params import SamplingParams

    config = {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "max_lora_rank": opts.rank,
              **(opts.engine or {})}
    llm = LLM(str(opts.model), max_loras=count, num_threads=torch.get_num_threads(), **config)
    names = [f"a{i}" for i in range(count)]
    for name, path in zip(names, adapters, strict=False):
        llm.add_lora(name, str(path))
    lora = [names[i % count] if count else None for i in range(len(prompts))]
    params = SamplingParams(max_tokens=opts.max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], params, lora=lora[:2])  # warm up

    def generate() -> None:
        llm.generate(prompts, params, lora=lora)

    return generate


def _peft_run(opts: LoraOptions, adapters: list[Path], prompts: list[list[int]]) -> Callable[[], None]:
    """transformers + PEFT: every adapter loaded (unmerged), its requests in batches, one adapter after
    another."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(opts.model, dtype=torch.float32)
    model: Any = PeftModel.from_pretrained(base, adapters[0], adapter_name="a0")
    for i, path in enumerate(adapters[1:], start=1):
        model.load_adapter(path, adapter_name=f"a{i}")
    model.eval()
    groups = [[p for j, p in enumerate(prompts) if j % len(adapters) == i] for i in range(len(adapters))]

    def generate() -> None:
        for i, group in enumerate(groups):
            model.set_adapter(f"a{i}")
            for start in range(0, len(group), opts.peft_batch_size):
                batch = torch.tensor(group[start:start + opts.peft_batch_size])
                with torch.no_grad():
                    model.generate(input_ids=batch, attention_mask=torch.ones_like(batch), do_sample=False,
                                   max_new_tokens=opts.max_tokens, min_new_tokens=opts.max_tokens,
                                   pad_token_id=0)

    return generate


def _ratios(runs: list[SystemRun], opts: LoraOptions) -> dict[str, Any]:
    ours = {r.adapters: r.output_tokens_per_s for r in runs if r.system == "conveyor"}
    ratios: dict[str, Any] = {"vs_base": {str(n): ours[n] / ours[0] for n in opts.adapter_counts}}
    peer = next((r for r in runs if r.system != "conveyor"), None)
    if peer is not None:
        ratios["vs_peft"] = ours[peer.adapters] / peer.output_tokens_per_s
    return ratios


def _table(runs: list[SystemRun], report: dict[str, Any]) -> Table:
    title = "lora: conveyor with N adapters mixed / the base model alone"
    if "vs_peft" in report:
        title += f"; / transformers + PEFT = {report['vs_peft']:.2f}x"
    table = Table(title=title)
    base = next(r for r in runs if r.system == "conveyor" and r.adapters == 0)
    for column in ("system", "adapters", "best s", "output tok/s", "vs base alone"):
        table.add_column(column, justify="right")
    for r in runs:
        table.add_row(r.system, str(r.adapters or "base"), f"{r.seconds:.2f}", f"{r.output_tokens_per_s:.1f}",
                      f"{r.output_tokens_per_s / base.output_tokens_per_s:.2f}x")
    return table
