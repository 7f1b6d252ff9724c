"""The tuner's outputs: tune-report.md and tune-report.json (the baseline, each step with its decision, the
recommended settings against the baseline, per-group tables), the plots (bench/tune_plots.py), and
settings.toml, the recommended settings as Conveyor's config file takes them.

The snippet holds only the changed settings: an engine field is a top-level key, a queue's field a
`[queues.NAME]` table naming only that field. The service merges a partial `queues` table into the default
queues field by field (core/settings/service.py `_merge_queue_defaults`), so pasted into a config it keeps
every other queue, every other field of the queue, and every other setting as they were.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from conveyor.bench import plots
from conveyor.bench.metrics import ALL
from conveyor.bench.report import fmt, write_json_and_markdown
from conveyor.bench.tune_judge import ON_TIME, mean, mean_summary, objective_value, spread
from conveyor.bench.tune_params import Config, TuneParam, config_key
from conveyor.bench.tune_plots import objective_plot, on_time_plot

REPORT = "tune-report"
SNIPPET = "settings.toml"


def write_tune_report(data: dict[str, Any]) -> dict[str, Any]:
    """Writes the report, plots and snippet into data["out_dir"]; returns the report's JSON document."""
    out: Path = data["out_dir"]
    params: list[TuneParam] = data["params"]
    configs = [config_record(key, config, data["runs"][key], data["objective"])
               for key, config in data["configs"].items()]
    snippet = out / SNIPPET
    snippet.write_text(settings_snippet(params, data["baseline"], data["recommended"], data))
    document = {
        "trace": data["trace"],
        "input_set": data["input_set"],
        "model": data["model"],
        "trace_model": data["trace_model"],
        "settings_not_replayed": data["skipped_settings"],
        "baseline_from": data["baseline_from"],
        "objective": data["objective"],
        "objective_text": data["objective_text"],
        "repeats": data["repeats"],
        "passes": data["passes"],
        "budget_min": data["budget_min"],
        "budget_exhausted": data["budget_exhausted"],
        "parameters": [{"name": p.name, "values": list(p.values)} for p in params],
        "baseline": _find(configs, config_key(params, data["baseline"])),
        "recommended": _find(configs, config_key(params, data["recommended"])),
        "changes": changes(params, data["baseline"], data["recommended"]),
        "configurations": configs,
        "steps": [step_record(s) for s in data["steps"]],
        "untried": data["untried"],
        "engine_runs": data["engine_runs"],
        "run_log": str(data["run_log"]),
        "snippet": str(snippet),
        "plots": write_plots(configs, out) if plots.available() else [],
    }
    write_json_and_markdown(document, report_markdown(document, snippet.read_text()), out, REPORT)
    return document


def config_record(key: str, config: Config, runs: list[dict[str, Any]], objective: str) -> dict[str, Any]:
    values = [objective_value(r, objective) for r in runs]
    return {
        "key": key,
        "configuration": config,
        "objective": {"values": values, "mean": mean(values), "spread": spread(values)},
        "metrics": mean_summary(runs)["metrics"],
    }


def step_record(step: Any) -> dict[str, Any]:
    d = step.decision
    return {
        "step": step.number,
        "pass": step.pass_number,
        "parameter": step.param.name,
        "from": step.current[step.param.name],
        "to": step.candidate[step.param.name],
        "current": step.current,
        "adopted": d["approved"],
        "objective_current": d["current"],
        "objective_candidate": d["candidate"],
        "gain": d["gain"],
        "noise": d["noise"],
        "reason": d["reason"],
        "checks": d["checks"],
        "sheet": str(step.sheet),
    }


def changes(params: list[TuneParam], base: Config, best: Config) -> dict[str, dict[str, Any]]:
    return {p.name: {"baseline": base[p.name], "recommended": best[p.name]}
            for p in params if base[p.name] != best[p.name]}


def _find(configs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    return next(c for c in configs if c["key"] == key)


# --- the settings snippet ----------------------------------------------------------------------------


def settings_snippet(params: list[TuneParam], base: Config, best: Config, data: dict[str, Any]) -> str:
    """settings.toml: the changed settings only (see the module docstring), and comments saying so."""
    lines = [
        f"# Recommended by `conveyor tune` (objective {data['objective']}) on {data['trace']}",
        f"# (sha256 {data['input_set']['trace_sha256']}).",
        "# Paste into the file `conveyor serve --config` reads: only the changed settings are here; every",
        "# other setting, queue and queue field keeps its value.",
    ]
    if data["trace_model"]:
        model = data["trace_model"]
        lines.append(f"# For the model {model}: where it sets its own engine settings or queues in "
                     f"[models.{model}], put these there.")
    unchanged = [p for p in params if base[p.name] == best[p.name]]
    if unchanged:
        lines.append(f"# Unchanged from the baseline ({data['baseline_from']}), so not set here:")
    lines += [f"#   {p.name} = {_toml_value(best[p.name])}" for p in unchanged]
    engine = [p for p in params if p.queue() is None and base[p.name] != best[p.name]]
    lines += [_toml_line(p.name, best[p.name]) for p in engine]
    queues: dict[str, list[TuneParam]] = {}
    for p in params:
        where = p.queue()
        if where is not None and base[p.name] != best[p.name]:
            queues.setdefault(where[0], []).append(p)
    for queue, fields in queues.items():
        lines += ["", f"[queues.{queue}]"]
        lines += [_toml_line(p.name.rsplit(".", 1)[1], best[p.name]) for p in fields]
    return "\n".join(lines) + "\n"


def _toml_line(name: str, value: Any) -> str:
    if value is None:  # TOML has no null: an unset setting is one left out
        return f"# {name}: unset (leave it out of the config)"
    return f"{name} = {_toml_value(value)}"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    if value is None:
        return "unset"
    raise ValueError(f"settings snippet: cannot write {value!r} as a TOML value")


# --- Markdown ----------------------------------------------------------------------------------------


def report_markdown(doc: dict[str, Any], snippet: str) -> str:
    base, best = doc["baseline"], doc["recommended"]
    inputs = doc["input_set"]
    parts = [
        f"# Tuning on {doc['trace']}: {doc['objective']}",
        "",
        f"- **Input set**: {inputs['description']} ({inputs['num_requests']} requests, trace sha256 "
        f"`{inputs['trace_sha256']}`); model {doc['model']}"
        + (f" (the trace's {doc['trace_model']})" if doc["trace_model"] else ""),
        f"- **Baseline**: {doc['baseline_from']}.",
        f"- **Objective**: {doc['objective']}: {doc['objective_text']}.",
        f"- **Method**: the baseline, then one parameter at a time, its values in the order given, each "
        f"against the current best ({doc['passes']} pass(es)); {doc['repeats']} runs per configuration. "
        "A change is adopted when its mean objective beats the current best's by more than the noise "
        "(the larger spread, max - min, of the two configurations' runs) and every group with a deadline "
        "keeps its on-time share (candidate mean >= current mean - current spread).",
        f"- **Budget**: {fmt(doc['budget_min'])} min; "
        + (f"exhausted, {len(doc['untried'])} candidate(s) untried (below)" if doc["budget_exhausted"]
           else "every candidate was tried")
        + f"; {doc['engine_runs']} run(s) made by this invocation, the others found in the resume file.",
    ]
    if doc["settings_not_replayed"]:
        parts.append(f"- **Production settings not replayed** (they describe its machine): "
                     f"{', '.join(doc['settings_not_replayed'])}")
    parts += ["", "## Recommended settings", "", "| parameter | baseline | recommended |", "|---|---|---|"]
    parts += [f"| `{p['name']}` | {base['configuration'][p['name']]} | {best['configuration'][p['name']]} |"
              for p in doc["parameters"]]
    parts += ["", f"{doc['objective']}: baseline {_objective_text(base)}, recommended "
              f"{_objective_text(best)}.", "", f"`{doc['snippet']}`:", "", "```toml", snippet.rstrip(), "```",
              ""]
    parts += ["## Steps", "", "| # | pass | parameter | from | to | current | candidate | gain | noise | "
              "decision | reason | sheet |", "|---" * 12 + "|"]
    for s in doc["steps"]:
        sheet = Path(s["sheet"])
        parts.append(
            f"| {s['step']} | {s['pass']} | `{s['parameter']}` | {s['from']} | {s['to']} | "
            f"{_objective_text(s['objective_current'])} | {_objective_text(s['objective_candidate'])} | "
            f"{fmt(s['gain'])} | {fmt(s['noise'])} | {'ADOPTED' if s['adopted'] else 'rejected'} | "
            f"{s['reason']} | [{sheet.name}]({sheet.parent.name}/{sheet.name}) |"
        )
    parts += ["", "## Configurations tried", "", "| # | configuration | objective per run | mean | spread |",
              "|---|---|---|---|---|"]
    parts += [f"| {i} | `{c['key']}` | {', '.join(fmt(v) for v in c['objective']['values'])} | "
              f"{fmt(c['objective']['mean'])} | {fmt(c['objective']['spread'])} |"
              for i, c in enumerate(doc["configurations"])]
    if doc["untried"]:
        parts += ["", "## Left untried (budget)", ""]
        parts += [f"- pass {u['pass']}: `{u['parameter']}` = {u['value']}" for u in doc["untried"]]
    same = base["key"] == best["key"]
    tables = [("baseline, also the recommended settings", base)] if same else [
        ("baseline", base), ("recommended", best)]
    for title, config in tables:
        parts += ["", f"## Per group: {title} (`{config['key']}`), means over the runs", "",
                  group_table(config["metrics"])]
    if doc["plots"]:
        parts += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in doc["plots"]]
    return "\n".join(parts) + "\n"


def _objective_text(figures: dict[str, Any]) -> str:
    if "objective" in figures:
        figures = figures["objective"]
    return f"{fmt(figures['mean'])} (spread {fmt(figures['spread'])})"


GROUP_COLUMNS = ("group", "submitted", "completed", "on time", "on-time share", "goodput/s", "failed",
                 "cancelled", "queue p50 / p95", "TTFT p50 / p95", "e2e p50 / p95", "preemptions", "peak KV")


def group_table(metrics: dict[str, dict[str, Any]]) -> str:
    """One row per group and "all": the counts (one rule for every run), on-time figures, latencies (s)."""
    lines = ["| " + " | ".join(GROUP_COLUMNS) + " |", "|---" * len(GROUP_COLUMNS) + "|"]
    for group in [*(g for g in metrics if g != ALL), ALL]:
        m = metrics[group]
        cells = [group, fmt(m["submitted"]), fmt(m["completed"]), fmt(m.get("on_time")),
                 fmt(m.get(ON_TIME), share=True), fmt(m.get("goodput_rps")), fmt(m["failed"]),
                 fmt(m["cancelled"])]
        cells += [f"{fmt(m[f'{name}_s']['p50'])} / {fmt(m[f'{name}_s']['p95'])}"
                  for name in ("queue_time", "ttft", "e2e")]
        cells += [fmt(m["preemptions"]), fmt(m["peak_kv_usage"], share=True)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def repeats_markdown(sheet: dict[str, Any]) -> str:
    """The decision sheet's own section: each run's objective, the means and the spreads, then per group the
    figures the tuner reads (on-time share, goodput) beside the latencies and counts."""
    d = sheet["decision"]
    rows = [("current best (baseline above)", d["current"]), ("candidate", d["candidate"])]
    lines = ["", f"## Repeats: {d['objective']} per run", "", "| configuration | runs | mean | spread |",
             "|---|---|---|---|"]
    lines += [f"| {name} | {', '.join(fmt(v) for v in f['values'])} | {fmt(f['mean'])} | {fmt(f['spread'])} |"
              for name, f in rows]
    lines += ["", f"Gain {fmt(d['gain'])}, noise {fmt(d['noise'])}: {d['reason']}. The tables above are "
              f"means over the {sheet['repeats']} runs of each configuration."]
    for name in ("baseline", "candidate"):
        lines += ["", f"Per group, {name} ({sheet['parameter']} = {sheet[f'{name}_value']}): on time, queue "
                  "time, latencies (s), errors, cancellations", "", group_table(sheet[name])]
    return "\n".join([*lines, ""])


def write_plots(configs: list[dict[str, Any]], out: Path) -> list[str]:
    labels = [f"{i}" for i in range(len(configs))]
    return [str(objective_plot(labels, configs, out / "tune_objective.png")),
            str(on_time_plot(labels, configs, out / "tune_on_time.png"))]
