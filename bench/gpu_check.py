"""`make gpu-check` / `python -m conveyor.bench.gpu_check`: the GPU check in one command, under 10 minutes on
a CUDA machine. Six stages, each in a child process of its own with its own time budget, inside a total
budget:

- kernels: bench/kernels.py's paged-attention cases, with achieved bandwidth against a measured device copy;
- quant: the Triton int8/int4 dequantize-and-multiply kernel against its reference, timed against the dense
  matmul (bench/gpu_check_stages.py quant_stage);
- speculation: SmolLM2-135M-Instruct answers the bench's `quoting` prompts with suffix drafts and without,
  greedy and seeded: the tokens must be equal; acceptance and the speed-up recorded;
- engine: `conveyor bench --peer hf` on the ~1.1B-parameter `llama-1b` preset in bf16 (the engine against
  transformers' continuous batching and static batches);
- moe: the same on the `mixtral-1b` preset (8 experts, 2 per token: the fused Triton MoE kernel against
  transformers' MoE);
- service: `conveyor serve` on a free port with that model, the bench's `service` profile, then stopped.

A stage that fails, crashes or runs out of time is recorded as such and the next one still runs (its child
process group is ended, so a server it started goes with it). Writes gpu-check.json and gpu-check.md to
--out; exit status 1 when any stage did not pass.

Without CUDA it says so and exits 0 unless --cpu is given: a rehearsal of the same pipeline with tiny shapes
(the kernel interpreter's smoke cases, preset:tiny in fp32, a few one-token jobs) in about a minute.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import shlex
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from conveyor.bench.gpu_check_report import report_markdown
from conveyor.bench.gpu_check_stages import (
    Plan,
    cpu_plan,
    engine_stage,
    gpu_plan,
    kernel_stage,
    moe_stage,
    quant_stage,
    service_stage,
    speculation_stage,
)

StageFn = Callable[[Plan], dict[str, Any]]
STAGES: dict[str, StageFn] = {"kernels": kernel_stage, "quant": quant_stage, "speculation": speculation_stage,
                              "engine": engine_stage, "moe": moe_stage, "service": service_stage}
DEFAULT_BUDGET_S = 540.0  # the whole run: 9 minutes, inside the 10 the check promises
# Each stage's own limit (seconds); the total budget clips the later ones.
GPU_BUDGETS = {"kernels": 80.0, "quant": 40.0, "speculation": 60.0, "engine": 160.0, "moe": 95.0,
               "service": 105.0}
CPU_BUDGETS = {"kernels": 60.0, "quant": 30.0, "speculation": 60.0, "engine": 120.0, "moe": 90.0,
               "service": 90.0}
MIN_STAGE_S = 5.0  # a stage that would get less than this of the total budget is skipped
STOP_GRACE_S = 10.0  # after SIGTERM, before SIGKILL: time for a stage to stop the server it started
CPU_TORCH = (
    "conveyor.bench.gpu_check: nvidia-smi is here but torch {version} sees no CUDA device: install a CUDA "
    "build of torch into .venv (docs/benchmarks/gpu-check.md), or check the driver; --cpu runs the CPU "
    "rehearsal."
)
NO_CUDA = (
    "conveyor.bench.gpu_check: no CUDA device, so nothing is measured. `--cpu` (make gpu-check ARGS=--cpu) "
    "rehearses the whole check with tiny shapes on the CPU."
)


@dataclass
class StageOutcome:
    name: str
    status: str  # passed | failed | timed out | skipped
    seconds: float
    budget_s: float
    figures: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # why it did not pass: an exception, the checks that failed, or the timeout

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m conveyor.bench.gpu_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="the CPU rehearsal: tiny shapes, fp32, same pipeline")
    p.add_argument("--out", type=Path, default=Path("bench-out/gpu-check"), help="report folder")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, metavar="SECONDS", help="whole run")
    p.add_argument(
        "--stage-budget",
        action="append",
        default=[],
        metavar="STAGE=SECONDS",
        help=f"one stage's limit (GPU defaults: {_pairs_text(GPU_BUDGETS)})",
    )
    p.add_argument(
        "--stages",
        default=",".join(STAGES),
        metavar="A,B",
        help=f"the stages to run, in this order (default: all, {','.join(STAGES)})",
    )
    p.add_argument(
        "--service-model",
        choices=("preset", "demo"),
        default="preset",
        help="the server's model: the engine stage's (default) or the service's default one (SmolLM2-135M)",
    )
    p.add_argument(
        "--model-cache",
        type=Path,
        default=Path.home() / ".cache" / "conveyor" / "bench-models",
        help="where the preset models are built (once)",
    )
    return p


def parse_stages(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in STAGES]
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(f"--stages: expected distinct names among {list(STAGES)}, got {text!r}")
    return names


def parse_budgets(items: list[str], defaults: dict[str, float]) -> dict[str, float]:
    budgets = dict(defaults)
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or name not in STAGES:
            raise ValueError(
                f"--stage-budget: expected STAGE=SECONDS with STAGE in {list(STAGES)}, got {item!r}"
            )
        try:
            budgets[name] = float(value)
        except ValueError:
            raise ValueError(f"--stage-budget: {item!r}: SECONDS must be a number") from None
        if budgets[name] <= 0:
            raise ValueError(f"--stage-budget: {item!r}: SECONDS must be > 0")
    return budgets


# --- running the stages ------------------------------------------------------------------------------


def run_stages(
    plan: Plan, stages: Sequence[tuple[str, StageFn, float]], total_s: float
) -> list[StageOutcome]:
    """Each stage in turn, within its own budget and what is left of the total; none stops the others."""
    start = time.monotonic()
    outcomes = []
    for name, fn, budget_s in stages:
        left = total_s - (time.monotonic() - start)
        budget = min(budget_s, left)
        if budget < MIN_STAGE_S:
            outcomes.append(StageOutcome(name, "skipped", 0.0, budget_s, error="the total budget is spent"))
            continue
        print(f"== gpu-check: {name} (budget {budget:.0f} s)", flush=True)
        outcome = run_stage(name, fn, plan, budget)
        print(f"== gpu-check: {name} {outcome.status} in {outcome.seconds:.1f} s", flush=True)
        outcomes.append(outcome)
    return outcomes


def run_stage(name: str, fn: StageFn, plan: Plan, budget_s: float) -> StageOutcome:
    """`fn(plan)` in a fresh (spawned) process: a crash, a hang or a CUDA error stays there, and its device
    memory is returned before the next stage."""
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_stage_child, args=(fn, plan, send), name=f"gpu-check-{name}")
    t0 = time.monotonic()
    child.start()
    send.close()  # the child holds the only sending end: its exit reads as EOF here
    try:
        message = _await_message(receive, t0 + budget_s)
        seconds = time.monotonic() - t0
        if message is not None:  # it has reported: let it exit by itself (atexit hooks, stopping the server)
            child.join(STOP_GRACE_S)
    finally:  # Ctrl-C too: in a process group of its own, the stage does not get the terminal's SIGINT
        _stop(child)
    if message is None:
        if seconds >= budget_s:
            return StageOutcome(name, "timed out", seconds, budget_s, error=f"stopped after {budget_s:.0f} s")
        error = f"the stage's process exited with code {child.exitcode} before reporting"
        return StageOutcome(name, "failed", seconds, budget_s, error=error)
    if "error" in message:
        figures = {"traceback": message["traceback"]}
        return StageOutcome(name, "failed", seconds, budget_s, figures, message["error"])
    figures = message["figures"]
    if not figures.get("ok", False):
        error = "; ".join(figures.get("problems") or ["the stage's checks failed"])
        return StageOutcome(name, "failed", seconds, budget_s, figures, error)
    return StageOutcome(name, "passed", seconds, budget_s, figures)


def _await_message(receive: Connection, deadline: float) -> dict[str, Any] | None:
    while (left := deadline - time.monotonic()) > 0:
        if receive.poll(min(left, 0.5)):
            try:
                message: dict[str, Any] = receive.recv()
                return message
            except EOFError:  # the child ended without a word
                return None
    return None


def _stage_child(fn: StageFn, plan: Plan, send: Connection) -> None:
    os.setpgrp()  # its own process group: stopping the stage stops whatever it started (the server) too
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so `finally` blocks (stopping the server) still run
    try:
        send.send({"figures": fn(plan)})
    except BaseException as exc:
        tail = traceback.format_exc().strip().splitlines()[-6:]
        send.send({"error": f"{type(exc).__name__}: {exc}", "traceback": tail})
    finally:
        send.close()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(f"stopped by signal {signum} (time budget)")


def _stop(child: multiprocessing.process.BaseProcess) -> None:
    """SIGTERM to the stage's process group, SIGKILL after a grace period; then the group's leftovers."""
    if child.is_alive():
        _signal_group(child, signal.SIGTERM)
        child.join(STOP_GRACE_S)
    _signal_group(child, signal.SIGKILL)  # anything of the group still running (a stuck server)
    child.join()


def _signal_group(child: multiprocessing.process.BaseProcess, sig: int) -> None:
    assert child.pid is not None
    try:
        os.killpg(child.pid, sig)
    except ProcessLookupError:  # the group is gone, or the child died before making it
        if child.is_alive():
            os.kill(child.pid, sig)


# --- the report --------------------------------------------------------------------------------------


def build_report(
    plan: Plan, outcomes: list[StageOutcome], total_s: float, seconds: float, argv: list[str]
) -> dict[str, Any]:
    return {
        "title": "GPU check" if plan.mode == "gpu" else "GPU check, CPU rehearsal (tiny shapes)",
        "mode": plan.mode,
        "ok": all(o.passed for o in outcomes),
        "command": shlex.join(["python", "-m", "conveyor.bench.gpu_check", *argv]),
        "budget_s": total_s,
        "seconds": seconds,
        "plan": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(plan).items()},
        "stages": [dataclasses.asdict(o) for o in outcomes],
        "inventory": device_inventory(),
    }


def write_report(report: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    from conveyor.bench.report import write_json_and_markdown

    return write_json_and_markdown(report, report_markdown(report), out_dir, "gpu-check")


def device_inventory() -> dict[str, Any]:
    """The bench's inventory (version, commit, host, torch), plus the device and its software stack."""
    import torch

    from conveyor.bench.inventory import inventory

    inv = inventory(None, {})
    del inv["parameters"], inv["model"]
    inv["triton_version"] = _version("triton")
    inv["cuda_version"] = torch.version.cuda
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        inv["device"].update(
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            count=torch.cuda.device_count(),
        )
        inv["cudnn_version"] = torch.backends.cudnn.version()
    return inv


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _pairs_text(values: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in values.items())


# --- the command -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        names = parse_stages(args.stages)
        budgets = parse_budgets(args.stage_budget, CPU_BUDGETS if args.cpu else GPU_BUDGETS)
        if args.budget <= 0:
            raise ValueError(f"--budget: must be > 0, got {args.budget}")
    except ValueError as exc:
        print(f"conveyor.bench.gpu_check: {exc}", file=sys.stderr)
        return 2
    import torch

    if not args.cpu and not torch.cuda.is_available():
        if shutil.which("nvidia-smi"):  # a GPU this torch cannot use: say so rather than pass quietly
            print(CPU_TORCH.format(version=torch.__version__), file=sys.stderr)
            return 2
        print(NO_CUDA)
        return 0
    # The stage processes inherit the environment, and Triton reads this variable when the kernel modules
    # are imported: the interpreter for Triton on CPU tensors, never on the GPU (it would time out there).
    if args.cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif os.environ.pop("TRITON_INTERPRET", None):
        print("conveyor.bench.gpu_check: TRITON_INTERPRET is set; unset for the stages, so the kernels run "
              "compiled")
    make_plan = cpu_plan if args.cpu else gpu_plan
    plan = make_plan(args.out, args.model_cache, args.service_model)
    start = time.monotonic()
    outcomes = run_stages(plan, [(n, STAGES[n], budgets[n]) for n in names], args.budget)
    report = build_report(plan, outcomes, args.budget, time.monotonic() - start, argv)
    json_path, md_path = write_report(report, args.out)
    for o in outcomes:
        print(
            f"{o.name}: {o.status} ({o.seconds:.1f} s of {o.budget_s:.0f})"
            + (f": {o.error}" if o.error else "")
        )
    print(f"gpu-check {'passed' if report['ok'] else 'FAILED'}; report: {md_path} and {json_path}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
