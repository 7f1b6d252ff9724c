"""`conveyor tune`: argument parsing onto the tuner (bench/tune.py), then a check that the settings snippet
it wrote loads as `conveyor serve --config` would load it and holds the recommended values. It lives in
cli/ because that check reads the service's settings (core), which the bench may not import."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from conveyor.bench.cli import DEFAULT_MODEL_CACHE, apply_threads, resolve_model, run_console
from conveyor.bench.experiment import BenchOptions
from conveyor.bench.trace_replay import read_trace_header
from conveyor.bench.tune import TuneOptions, tune
from conveyor.bench.tune_judge import OBJECTIVES
from conveyor.bench.tune_params import TuneParam, parse_params, production_options, replayed_model
from conveyor.bench.workload import WorkloadSpec
from conveyor.core.settings.engine import EngineSettings
from conveyor.core.settings.service import load_settings

DESCRIPTION = (
    "Tune the engine and queue settings on a trace (`conveyor trace export`, or a hand-written one): a "
    "baseline (production's settings as the trace's header recorded them, else the bench's defaults), then "
    "one change at a time from the current best, each configuration run --repeats times; a change is adopted "
    "when its mean objective beats the current best's by more than the spread (max - min) of the runs and "
    "no group with a deadline loses on-time share. Writes a decision sheet per change, tune-report.md/.json, "
    "plots and settings.toml (the recommended settings for `conveyor serve --config`). Interrupted, it "
    "resumes from the runs it finished (the same --out)."
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="conveyor tune", description=DESCRIPTION)
    p.add_argument("--trace", required=True, type=Path, help="the JSONL trace to replay")
    p.add_argument("--trace-model", help="the model whose jobs are replayed, in a trace of several")
    p.add_argument("--model", help="the model to run (a folder, GGUF file, hub id, package:DIST or "
                   "preset:NAME); default: the replayed model's source in the trace's header")
    p.add_argument("--model-cache", type=Path, default=DEFAULT_MODEL_CACHE, help="where presets are built")
    p.add_argument(
        "--param", action="append", default=[], metavar="NAME=V1,V2,...",
        help="a parameter and the values to try, in order (repeatable): an engine field (max_num_seqs, "
        "max_num_batched_tokens, long_prefill_token_threshold, ...) or queues.QUEUE.max_running / "
        "queues.QUEUE.priority for a queue of the trace; a value equal to the current best's is no change",
    )
    objectives = "; ".join(f"{name}: {text}" for name, (_, text) in OBJECTIVES.items())
    p.add_argument("--objective", choices=list(OBJECTIVES), default="goodput",
                   help=f"what a change must raise (all groups together): {objectives}. Default goodput")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs per configuration, for the spread (default 3)")
    p.add_argument("--passes", type=int, default=1,
                   help="sweeps over the parameter list, each from the best so far (default 1)")
    p.add_argument("--budget", type=float, default=30.0, metavar="MINUTES",
                   help="no run starts after this many minutes (the baseline always runs); the report lists "
                   "what was left untried (default 30)")
    p.add_argument("--load", type=float, help="replay at this multiple of the recorded pace (arrival_s / X)")
    p.add_argument("--out", type=Path, help="where the runs, sheets and report go (default "
                   "tune-out/<trace stem>); a second run with the same trace and parameters continues there")
    p.add_argument("--fresh", action="store_true", help="discard the runs already in --out and start over")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts synthesised from token counts")
    return p


def options(args: argparse.Namespace, console: Console) -> tuple[BenchOptions, TuneOptions]:
    """The baseline's bench options and the search's, every input checked before any run."""
    model_id, entry = replayed_model(read_trace_header(args.trace), args.trace_model)
    source = args.model or entry.get("source")
    if not source:
        raise ValueError("model: the trace's header names no model source; give --model")
    bench_opts = BenchOptions(
        model=resolve_model(source, args.model_cache), trace=str(args.trace), trace_model=args.trace_model,
        spec=WorkloadSpec(seed=args.seed), load=args.load, progress=False,
    )
    bench_opts, skipped = production_options(bench_opts, entry)
    apply_threads(None, bench_opts, console)
    params = parse_params(args.param, bench_opts)
    for p in params:
        check_service_setting(p)
    out = args.out or Path("tune-out") / args.trace.stem
    tune_opts = TuneOptions(
        trace=args.trace, params=params, out_dir=out, objective=args.objective, repeats=args.repeats,
        passes=args.passes, budget_min=args.budget, fresh=args.fresh, progress=not args.no_progress,
        model_source=source, model_id=model_id, skipped_settings=skipped,
        baseline_from=f"production's settings of {model_id} in the trace's header" if entry else
        "the bench's defaults (the trace's header records no production settings)",
    )
    return bench_opts, tune_opts


def check_service_setting(param: TuneParam) -> None:
    """The snippet carries only what the service's config file sets: an engine field the service does not
    know (the bench's own, e.g. seed) could be tuned but never deployed."""
    if param.queue() is None and param.name not in EngineSettings.model_fields:
        raise ValueError(f"param {param.name}: not a setting of `conveyor serve`; tunable engine settings: "
                         f"{', '.join(sorted(EngineSettings.model_fields))}")


def check_snippet(path: Path, params: list[TuneParam], changes: dict[str, dict[str, Any]]) -> None:
    """The snippet loads with the service's own loader and holds every changed setting at its recommended
    value (None: unset). ValueError otherwise: a snippet that would not deploy what the report says."""
    settings = load_settings(path)
    for p in params:
        if p.name not in changes:
            continue  # unchanged: not in the snippet, the deployment's own value stands
        where = p.queue()
        loaded = getattr(settings, p.name) if where is None else getattr(settings.queues[where[0]], where[1])
        if loaded != changes[p.name]["recommended"]:
            raise ValueError(f"settings snippet {path}: {p.name} loads as {loaded!r}, not "
                             f"{changes[p.name]['recommended']!r} (a CONVEYOR_ variable wins over the file)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = run_console()
    if console is None:
        return 2
    threads_before = torch.get_num_threads()
    try:
        bench_opts, tune_opts = options(args, console)
        report = tune(bench_opts, tune_opts, console)
        check_snippet(Path(report["snippet"]), tune_opts.params, report["changes"])
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}", markup=True)
        return 2
    except KeyboardInterrupt:  # every finished run is in the state file already
        console.print("interrupted: the finished runs are kept; the same command resumes", markup=False)
        return 130
    finally:  # torch's thread count is process-wide: a caller in the same process gets its own back
        torch.set_num_threads(threads_before)
    changed = ", ".join(f"{k} {v['baseline']} -> {v['recommended']}" for k, v in report["changes"].items())
    console.print(f"recommended: {changed or 'the baseline (no change beat the noise)'}", markup=False)
    report_md = tune_opts.out_dir / "tune-report.md"
    console.print(f"report: {report_md}; settings: {report['snippet']}", markup=False)
    return 0
