"""`conveyor tune`: the seed's method on a trace. A baseline, then one change at a time (coordinate search):
each parameter's values in the order given, each against the current best, repeated to tell effect from
noise (bench/tune_judge.py), each with a decision sheet; an adopted change becomes the current best. A value
equal to the current best's is no change, and a pair of configurations already compared (either way round,
as going back to a value that lost) is not compared again. Runs
are kept in a resume file (bench/tune_state.py); the report, plots and settings snippet are
bench/tune_report.py's.

Budget: the baseline always runs; no other run starts once `budget_min` minutes have passed since this
invocation began (runs found in the resume file cost nothing), and the report lists what was left untried.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from conveyor.bench.console import progress_bar
from conveyor.bench.experiment import (
    BenchOptions,
    build_workload,
    run_summary,
    run_target,
    workload_record,
)
from conveyor.bench.inventory import inventory
from conveyor.bench.report import decision_markdown, write_json_and_markdown
from conveyor.bench.tune_judge import OBJECTIVES, check_objective, judge, mean_summary
from conveyor.bench.tune_params import Config, TuneParam, baseline_config, config_key, options_for
from conveyor.bench.tune_report import repeats_markdown, write_tune_report
from conveyor.bench.tune_state import TuneState, file_sha256

SHEETS_DIR = "sheets"
RUN_LOG = "tune-log.txt"


@dataclass
class TuneOptions:
    trace: Path
    params: list[TuneParam]
    out_dir: Path
    objective: str = "goodput"
    repeats: int = 3
    passes: int = 1
    budget_min: float = 30.0
    fresh: bool = False
    progress: bool = True
    model_source: str | None = None  # the model as given (--model or the header's), for the report
    model_id: str | None = None  # the trace's model replayed (its header's inventory), None without one
    skipped_settings: list[str] = field(default_factory=list)  # production's settings not replayed
    baseline_from: str = "the bench's defaults"  # where the baseline's settings came from, in words

    def __post_init__(self) -> None:
        check_objective(self.objective)
        if self.repeats < 1 or self.passes < 1:
            raise ValueError(f"repeats and passes must be >= 1, got {self.repeats} and {self.passes}")
        if self.budget_min < 0:
            raise ValueError(f"budget must be >= 0 minutes, got {self.budget_min}")


@dataclass
class Step:
    """One candidate judged against the current best."""

    number: int
    pass_number: int
    param: TuneParam
    current: Config
    candidate: Config
    decision: dict[str, Any]
    sheet: Path


class Search:
    """One tuning: the runs (found in the state or measured), the steps, what was left untried."""

    def __init__(self, opts: BenchOptions, tune_opts: TuneOptions, console: Console,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.opts, self.t, self.console, self.clock = opts, tune_opts, console, clock
        self.started = clock()
        self.trace_sha = file_sha256(tune_opts.trace)
        self.state = TuneState.open(tune_opts.out_dir, self.identity(), tune_opts.fresh)
        if tune_opts.fresh:  # the earlier tuning's sheets and log would read as this one's
            self.forget_outputs()
        self.requests, description = build_workload(opts)
        self.input_set = workload_record(opts, self.requests, description, self.trace_sha)
        self.steps: list[Step] = []
        self.untried: list[dict[str, Any]] = []
        self.configs: dict[str, Config] = {}  # every configuration measured in full, by key, in order
        self.engine_runs = 0  # runs made by this invocation (not found in the state)
        self.advance: Callable[[int], None] = lambda n: None

    def identity(self) -> dict[str, Any]:
        return {
            "trace_sha256": self.trace_sha,
            "params": [[p.name, list(p.values)] for p in self.t.params],
            "model": self.t.model_source or self.opts.model,
            "trace_model": self.t.model_id,
            "load": self.opts.load,
            "seed": self.opts.spec.seed,
        }

    def forget_outputs(self) -> None:
        for sheet in (self.t.out_dir / SHEETS_DIR).glob("*.*"):
            if sheet.suffix in (".json", ".md"):
                sheet.unlink()
        (self.t.out_dir / RUN_LOG).unlink(missing_ok=True)

    def out_of_budget(self) -> bool:
        return self.clock() - self.started >= self.t.budget_min * 60

    def planned_runs(self) -> int:
        return self.t.repeats * (1 + self.t.passes * sum(len(p.values) for p in self.t.params))

    def run(self) -> dict[str, Any]:
        with progress_bar(self.console, "tune", self.planned_runs(), self.t.progress) as advance:
            self.advance = advance
            base = baseline_config(self.t.params, self.opts)
            base_runs = self.measure(base, baseline=True)
            assert base_runs is not None, "the baseline runs whatever the budget"
            best, best_runs = base, base_runs
            for pass_number in range(1, self.t.passes + 1):
                best, best_runs = self.sweep(pass_number, best, best_runs)
        return write_tune_report(self.report(base, best))

    def sweep(self, pass_number: int, best: Config, best_runs: list[dict[str, Any]]
              ) -> tuple[Config, list[dict[str, Any]]]:
        """One pass over the parameter list from the current best; returns the best after it."""
        # Pairs already compared, either way round: going back to a value that lost teaches nothing.
        judged = {frozenset((config_key(self.t.params, s.current), config_key(self.t.params, s.candidate)))
                  for s in self.steps}
        for param in self.t.params:
            for value in param.values:
                candidate = {**best, param.name: value}
                pair = frozenset((config_key(self.t.params, best), config_key(self.t.params, candidate)))
                if value == best[param.name] or pair in judged:  # not a change, or one decided before
                    self.advance(self.t.repeats)
                    continue
                judged.add(pair)
                runs = self.measure(candidate)  # runs found in the state need no budget
                if runs is None:
                    self.untried.append({"pass": pass_number, "parameter": param.name, "value": value,
                                         "from": dict(best)})
                    continue
                step = self.decide(pass_number, param, best, best_runs, candidate, runs)
                if step.decision["approved"]:
                    best, best_runs = candidate, runs
        return best, best_runs

    def measure(self, config: Config, baseline: bool = False) -> list[dict[str, Any]] | None:
        """The configuration's `repeats` run summaries: found in the state, else run now and saved. None
        when the budget ran out before they were all there (the baseline runs anyway)."""
        key = config_key(self.t.params, config)
        runs = self.state.finished(key)[: self.t.repeats]
        self.advance(len(runs))
        options = options_for(self.opts, self.t.params, config)
        while len(runs) < self.t.repeats:
            if not baseline and self.out_of_budget():
                return None
            result, engine = run_target(options, self.requests, self.console)
            del engine  # one engine (and its KV cache) in memory at a time
            summary = run_summary(options, result)
            self.engine_runs += 1
            self.state.add_run(key, summary)
            runs.append(summary)
            self.log(f"run {key} repeat {len(runs)}/{self.t.repeats}: {summary['duration_s']:.2f} s")
            self.advance(1)
        self.configs.setdefault(key, config)  # measured in full: in the report
        return runs

    def decide(self, pass_number: int, param: TuneParam, current: Config, current_runs: list[dict[str, Any]],
               candidate: Config, candidate_runs: list[dict[str, Any]]) -> Step:
        decision = judge(self.t.objective, current_runs, candidate_runs)
        number = len(self.steps) + 1
        value = candidate[param.name]
        sheet = self.sheet(param, current, current_runs, candidate, candidate_runs, decision)
        stem = f"{number:02d}-{param.name}={value}"
        _, md = write_json_and_markdown(sheet, decision_markdown(sheet) + repeats_markdown(sheet),
                                        self.t.out_dir / SHEETS_DIR, stem)
        step = Step(number, pass_number, param, current, candidate, decision, md)
        self.steps.append(step)
        verdict = "ADOPTED" if decision["approved"] else "REJECTED"
        self.log(f"step {number}: {param.name} {current[param.name]} -> {value}: {verdict}: "
                 f"{decision['reason']} (sheet {md})")
        return step

    def sheet(self, param: TuneParam, current: Config, current_runs: list[dict[str, Any]], candidate: Config,
              candidate_runs: list[dict[str, Any]], decision: dict[str, Any]) -> dict[str, Any]:
        """The decision sheet (report.decision_markdown's fields): "baseline" is the current best; figures
        are means over the repeats, the spread is in the decision's checks and `repeats`."""
        base_run, cand_run = mean_summary(current_runs), mean_summary(candidate_runs)
        what = OBJECTIVES[self.t.objective][1]
        return {
            "hypothesis": f"Changing {param.name} from {current[param.name]} to {candidate[param.name]}, "
                          f"all else as in the current best, raises {self.t.objective} ({what}) beyond the "
                          "noise between repeats without lowering any deadline group's on-time share.",
            "parameter": param.name,
            "baseline_value": current[param.name],
            "candidate_value": candidate[param.name],
            "input_set": {**self.input_set, "trace_path": str(self.t.trace)},
            "decision": decision,
            "baseline": base_run["metrics"],
            "candidate": cand_run["metrics"],
            "baseline_run": {k: v for k, v in base_run.items() if k != "metrics"},
            "candidate_run": {k: v for k, v in cand_run.items() if k != "metrics"},
            "configurations": {"baseline": current, "candidate": candidate},
            "repeats": len(current_runs),
            "inventory": inventory(self.opts.model, {
                "baseline": options_for(self.opts, self.t.params, current).parameters(),
                "candidate": options_for(self.opts, self.t.params, candidate).parameters(),
            }, self.opts.thread_choice),
        }

    def log(self, line: str) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.t.out_dir.mkdir(parents=True, exist_ok=True)
        with (self.t.out_dir / RUN_LOG).open("a") as f:
            f.write(f"{stamp} {line}\n")
        self.console.print(line, markup=False)

    def report(self, base: Config, best: Config) -> dict[str, Any]:
        """Everything the report is written from (bench/tune_report.py)."""
        runs = {key: self.state.finished(key)[: self.t.repeats] for key in self.configs}
        return {
            "out_dir": self.t.out_dir,
            "trace": str(self.t.trace),
            "input_set": self.input_set,
            "model": self.t.model_source or self.opts.model,
            "trace_model": self.t.model_id,
            "skipped_settings": self.t.skipped_settings,
            "baseline_from": self.t.baseline_from,
            "objective": self.t.objective,
            "objective_text": OBJECTIVES[self.t.objective][1],
            "repeats": self.t.repeats,
            "passes": self.t.passes,
            "budget_min": self.t.budget_min,
            "budget_exhausted": bool(self.untried),
            "params": self.t.params,
            "baseline": base,
            "recommended": best,
            "configs": self.configs,
            "runs": runs,
            "steps": self.steps,
            "untried": self.untried,
            "engine_runs": self.engine_runs,
            "run_log": self.t.out_dir / RUN_LOG,
        }


def tune(opts: BenchOptions, tune_opts: TuneOptions, console: Console,
         clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """Runs the search and writes the report; returns the report's JSON document (tune-report.json)."""
    if opts.target != "engine":
        raise ValueError("tune: runs the in-process engine target")
    opts.progress = False  # the tuner's own bar stands for every run's
    return Search(opts, tune_opts, console, clock).run()
