"""Writes a bench report (JSON + Markdown) and a decision sheet (JSON + Markdown)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conveyor.bench.metrics import LATENCIES, PERCENTILES

COUNT_COLUMNS = (
    ("submitted", "submitted"),
    ("completed", "completed"),
    ("cancelled", "cancelled"),
    ("failed", "failed"),
    ("deadline_attainment", "within deadline"),
    ("output_tokens_per_s", "output tok/s"),
    ("total_tokens_per_s", "total tok/s"),
    ("preemptions", "preemptions"),
    ("peak_kv_usage", "peak KV"),
    ("kv_waste", "KV waste"),
    ("peak_running", "peak running"),
)
SHARES = {"deadline_attainment", "peak_kv_usage", "kv_waste"}


def fmt(value: Any, share: bool = False) -> str:
    if value is None:
        return "n/a"
    if share:
        return f"{100 * value:.1f}%"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def metrics_markdown(summary: dict[str, dict[str, Any]]) -> str:
    groups = list(summary)
    lines = ["| group | " + " | ".join(label for _, label in COUNT_COLUMNS) + " |"]
    lines.append("|---" * (len(COUNT_COLUMNS) + 1) + "|")
    for g in groups:
        cells = [fmt(summary[g].get(key), key in SHARES) for key, _ in COUNT_COLUMNS]
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Latency in seconds, completed requests, " + " / ".join(f"p{p}" for p in PERCENTILES) + ":",
        "",
    ]
    lines.append("| group | queue time | TTFT | inter-token | end-to-end |")
    lines.append("|---|---|---|---|---|")
    for g in groups:
        cells = [" / ".join(fmt(summary[g][f"{name}_s"][f"p{p}"]) for p in PERCENTILES) for name in LATENCIES]
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def speculation_markdown(summary: dict[str, dict[str, Any]]) -> str:
    """Per group: tokens drafted, tokens accepted, acceptance rate ("-" when nothing was drafted)."""
    lines = ["| group | drafted tokens | accepted tokens | acceptance |", "|---|---|---|---|"]
    for g, m in summary.items():
        rate = m.get("acceptance_rate")
        cells = [str(m.get("drafted_tokens", 0)), str(m.get("accepted_tokens", 0)),
                 "-" if rate is None else fmt(rate, share=True)]
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def shows_speculation(*runs: dict[str, Any]) -> bool:
    """Whether any of these runs had speculation on (the engine says so) or drafted a token."""
    return any(
        run.get("speculation") or any(m.get("drafted_tokens") for m in run.get("metrics", {}).values())
        for run in runs
    )


def speculation_section(summary: dict[str, dict[str, Any]]) -> list[str]:
    return ["", "Speculative decoding (tokens proposed for the requests, and accepted by verification):", "",
            speculation_markdown(summary)]


def speculation_text(spec: dict[str, Any]) -> str:
    """The engine's own speculation totals over a run, in words."""
    rate = spec.get("acceptance_rate")
    return (
        f"speculation {spec.get('method')}: {spec['accepted_tokens']} of {spec['drafted_tokens']} drafted "
        f"tokens accepted ({'-' if rate is None else fmt(rate, share=True)})"
    )


def eos_text(respect_eos: bool | None) -> str:
    """How the run's requests end, for the input set ("" for a record from before it was kept)."""
    if respect_eos is None:
        return ""
    if respect_eos:
        return "Requests stop at EOS: each answer is as long as the model made it, max_tokens only caps it."
    return "EOS ignored: every request generates exactly its max_tokens."


SERVICE_COLUMNS = (
    "run",
    "ok/sub",
    "failed",
    "refused",
    "submit/s",
    "submit p50 ms",
    "submit p99 ms",
    "done/s",
    "service p50 ms",
    "service p99 ms",
    "queue p99 ms",
    "wall s",
    "bench CPU s",
    "server CPU ms/job",
    "jobs/s per server core",
)


def service_cells(s: dict[str, Any]) -> list[str]:
    return [
        f"{s['succeeded']}/{s['submitted']}",
        str(s["failed"]),
        str(s["refused"]),
        fmt(s["submit_rate_per_s"]),
        _ms(s["submit_latency_s"]["p50"]),
        _ms(s["submit_latency_s"]["p99"]),
        fmt(s["completions_per_s"]),
        _ms(s["service_time_s"]["p50"]),
        _ms(s["service_time_s"]["p99"]),
        _ms(s["queue_time_s"]["p99"]),
        fmt(s["wall_s"]),
        fmt(s.get("client_cpu_s")),
        fmt(server_whole(s).get("cpu_ms_per_job")),
        fmt(server_whole(s).get("jobs_per_s_per_core")),
    ]


def server_whole(s: dict[str, Any]) -> dict[str, Any]:
    """The server's CPU figures as a whole: the `total` of several roles, else the one role ({} if none)."""
    roles = (s.get("server_cpu") or {}).get("roles") or {}
    if "total" in roles:
        return dict(roles["total"])
    return dict(next(iter(roles.values()))) if len(roles) == 1 else {}


def server_cpu_markdown(s: dict[str, Any]) -> list[str]:
    """The server's CPU per role (bench/server_cpu.py), and where the server and the bench ran."""
    cpu = s.get("server_cpu") or {}
    lines = [f"- CPU pinning: {pinning_text(s.get('pinning'))}"]
    if cpu.get("unknown"):
        lines.append(f"- {cpu['unknown']}")
    if not cpu.get("roles"):
        return lines
    lines += [
        "",
        f"Server CPU (user + system, process trees, over the run's {fmt(cpu['window_s'])} s):",
        "",
        "| process | pid | CPU s | cores used | CPU ms per job | jobs/s per core |",
        "|---|---|---|---|---|---|",
    ]
    for role, r in cpu["roles"].items():
        cells = [r["cpu_s"], r["cores_used"], r["cpu_ms_per_job"], r["jobs_per_s_per_core"]]
        lines.append(f"| {role} | {r['pid'] or ''} | " + " | ".join(fmt(c) for c in cells) + " |")
    return lines


def pinning_text(pinning: dict[str, Any] | None) -> str:
    if not pinning:
        return "n/a"
    if not pinning.get("pinned"):
        return str(pinning.get("reason"))
    pids = ", ".join(f"{role} {pid}" for role, pid in pinning.get("server_pids", {}).items())
    text = f"server on CPUs {pinning['server_cpus']}" + (f" ({pids})" if pids else "")
    text += f", bench on CPUs {pinning['client_cpus']}"
    notes = [pinning.get("server_note"), *pinning.get("errors", [])]
    return text + "".join(f"; {n}" for n in notes if n)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{1000 * seconds:.1f}"


def service_markdown(figures: dict[str, Any]) -> str:
    """The service figures of one HTTP run (bench/service.py): a table, then each kind of refusal."""
    lines = [
        "| " + " | ".join(SERVICE_COLUMNS[1:]) + " |",
        "|---" * (len(SERVICE_COLUMNS) - 1) + "|",
        "| " + " | ".join(service_cells(figures)) + " |",
    ]
    for k in figures["refusals"]:
        lines.append(f"- refused {k['count']}x: HTTP {k['status']} `{k['code']}`: {k['message']}")
    return "\n".join([*lines, *server_cpu_markdown(figures)])


def efficiency_markdown(eff: dict[str, Any]) -> str:
    lines = ["| figure | value |", "|---|---|"]
    lines.append(f"| model parameters | {eff['model_params'] / 1e6:.1f} M |")
    lines.append(
        f"| model GFLOP/s (over busy time: engine steps, else wall) | {eff['model_flops_per_s'] / 1e9:.2f} |"
    )
    if "matmul_bound" in eff:
        b = eff["matmul_bound"]
        shapes = ", ".join(f"{r['tokens']}: {r['flops_per_s'] / 1e9:.1f}" for r in b["buckets"])
        lines.append(f"| torch.mm GFLOP/s at the run's step shapes (tokens per step: GFLOP/s) | {shapes} |")
        lines.append(f"| matmul bound over the run (step-weighted) GFLOP/s | {b['flops_per_s'] / 1e9:.2f} |")
        lines.append(f"| share of the matmul bound | {fmt(eff['share_of_matmul_bound'], True)} |")
    if eff["overhead_share_all_steps"] is not None:  # only targets that report step and forward times
        lines.append(
            f"| engine overhead at batch >= {eff['overhead_min_batch']} ({eff['overhead_steps']} steps) "
            f"| {fmt(eff['overhead_share'], True)} |"
        )
        lines.append(f"| engine overhead, all steps | {fmt(eff['overhead_share_all_steps'], True)} |")
    return "\n".join(lines)


def inventory_markdown(inv: dict[str, Any]) -> str:
    model = inv["model"]
    lines = [
        f"- Conveyor {inv['conveyor_version']} at commit `{inv['git_commit']}`, "
        f"recorded {inv['recorded_at']}",
        f"- model `{model.get('path')}` (config.json sha256 `{model.get('config_sha256')}`)",
        f"- device {inv['device']}, memory {_gib(inv['memory_bytes'])}, {inv['cpu_count']} CPUs, "
        f"torch threads {inv['torch_threads']}",
        f"- torch {inv['torch_version']}, transformers {inv['transformers_version']}, "
        f"Python {inv['python_version']}, {inv['platform']}",
        "- parameters:",
        "",
        "```json",
        json.dumps(inv["parameters"], indent=2, sort_keys=True, default=str),
        "```",
    ]
    return "\n".join(lines)


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.1f} GiB"


def prefix_cache_text(cache: dict[str, Any] | None) -> str:
    """The run's prefix cache in words; "off" when the engine ran without it (or over HTTP: unknown)."""
    if cache is None:
        return "off"
    rate = fmt(cache["hit_rate"], share=True) if cache["hit_rate"] is not None else "n/a"
    return (
        f"hit rate {rate} ({cache['hit_tokens']} of {cache['queried_tokens']} prompt tokens looked up), "
        f"{cache['evictions']} evictions"
    )


def expert_load_text(counts: list[int]) -> str:
    """Load balance of a mixture of experts: the busiest expert's tokens against the mean (1.00 = even)."""
    mean = sum(counts) / len(counts)
    busiest = max(counts) / mean if mean else 0.0
    return (f"{len(counts)} experts, tokens per expert {min(counts)}-{max(counts)} (busiest {busiest:.2f}x "
            "the mean)")


def structured_line(figures: dict[str, Any]) -> str:
    """The constrained and the unconstrained requests of a run (--structured-share), side by side."""
    parts = []
    for name in ("constrained", "unconstrained"):
        m = figures[name]
        itl = m["itl_s"]["p50"]
        parts.append(
            f"{name} {m['completed']}/{m['submitted']}: {m['output_tokens_per_s']:.1f} output tok/s, "
            + (f"ITL p50 {itl * 1e3:.1f} ms" if itl is not None else "ITL n/a")
        )
    return "; ".join(parts)


def run_line(name: str, run: dict[str, Any]) -> str:
    """Wall time, and the prefix cache, decode step and structured-output figures of an in-process run."""
    line = f"{name}: wall time {run['duration_s']:.2f} s"
    if run.get("target") == "engine":
        line += f"; prefix cache {prefix_cache_text(run.get('prefix_cache'))}"
    if run.get("expert_tokens"):
        line += f"; {expert_load_text(run['expert_tokens'])}"
    if run.get("weights"):
        line += f"; weights {run['weights']['bytes'] / 2**20:.1f} MiB ({run['weights']['held_as']})"
    if run.get("decode_steps"):
        d = run["decode_steps"]
        line += (
            f"; decode step at batch {d['batch']}: {d['mean_s'] * 1e3:.1f} ms mean over {d['steps']} steps"
        )
    if run.get("structured"):
        line += f"; {structured_line(run['structured'])}"
    if run.get("speculation"):
        line += f"; {speculation_text(run['speculation'])}"
    return line


def wall_time_ratio(baseline: dict[str, Any], candidate: dict[str, Any]) -> str:
    b, c = baseline["duration_s"], candidate["duration_s"]
    return f"wall time end to end: baseline {b:.2f} s, candidate {c:.2f} s (candidate / baseline {c / b:.2f})"


def write_json_and_markdown(document: dict[str, Any], markdown: str, out_dir: Path,
                            stem: str) -> tuple[Path, Path]:
    """`<stem>.json` (the document) and `<stem>.md` (its Markdown) in `out_dir`, created if missing."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps(document, indent=2, default=str))
    md_path.write_text(markdown)
    return json_path, md_path


def write_report(report: dict[str, Any], out_dir: Path, stem: str = "report") -> tuple[Path, Path]:
    return write_json_and_markdown(report, report_markdown(report), out_dir, stem)


def report_markdown(report: dict[str, Any]) -> str:
    parts = [f"# Conveyor bench: {report['title']}", ""]
    w = report["workload"]
    parts += [
        f"Input set: {w['description']} ({w['num_requests']} requests, trace sha256 `{w['trace_sha256']}`). "
        f"{eos_text(w.get('respect_eos'))}".rstrip(),
        "",
    ]
    for name, run in report["runs"].items():
        parts += [
            f"## {name}",
            "",
            f"Wall time {run['duration_s']:.2f} s."
            + (
                f" Prefix cache: {prefix_cache_text(run.get('prefix_cache'))}."
                if run.get("target") == "engine"
                else ""
            )
            + (f" Experts: {expert_load_text(run['expert_tokens'])}." if run.get("expert_tokens") else ""),
            "",
            metrics_markdown(run["metrics"]),
        ]
        if shows_speculation(run):
            parts += speculation_section(run["metrics"])
        if run.get("decode_steps") or run.get("structured") or run.get("speculation"):
            parts += ["", run_line(name, run) + "."]
        if run.get("service"):
            parts += ["", "Service figures (latencies in ms):", "", service_markdown(run["service"])]
        if run.get("efficiency"):
            parts += ["", efficiency_markdown(run["efficiency"])]
        if run.get("notes"):
            parts += ["", *[f"- note: {n}" for n in run["notes"]]]
        parts.append("")
    if report.get("ratios"):
        parts += ["## Throughput ratios (output tokens/s)", ""]
        parts += [f"- {k}: {v:.2f}x" for k, v in report["ratios"].items()]
        parts.append("")
    if report.get("plots"):
        parts += ["## Plots", "", *[f"- `{p}`" for p in report["plots"]], ""]
    parts += ["## Inventory", "", inventory_markdown(report["inventory"]), ""]
    return "\n".join(parts)


def write_decision(sheet: dict[str, Any], out_dir: Path, stem: str = "decision") -> tuple[Path, Path]:
    return write_json_and_markdown(sheet, decision_markdown(sheet), out_dir, stem)


def decision_markdown(sheet: dict[str, Any]) -> str:
    verdict = "APPROVED" if sheet["decision"]["approved"] else "REJECTED"
    inputs = sheet["input_set"]
    parts = [
        f"# Decision sheet: {sheet['parameter']} = {sheet['candidate_value']} — {verdict}",
        "",
        f"- **Hypothesis**: {sheet['hypothesis']}",
        f"- **Changed parameter**: `{sheet['parameter']}`: {sheet['baseline_value']} -> "
        f"{sheet['candidate_value']} (nothing else changed)",
        f"- **Input set**: {inputs['description']} ({inputs['num_requests']} requests, "
        f"trace sha256 `{inputs['trace_sha256']}`). {eos_text(inputs.get('respect_eos'))}".rstrip(),
        "- **Approval condition** (all must hold): "
        + "; ".join(f"`{c['condition']}`" for c in sheet["decision"]["checks"]),
        f"- **Result**: {verdict}",
        "",
        "| condition | candidate | threshold | passed |",
        "|---|---|---|---|",
    ]
    for c in sheet["decision"]["checks"]:
        parts.append(
            f"| `{c['condition']}` | {fmt(c['candidate'])} | {fmt(c['threshold'])} | "
            f"{'yes' if c['passed'] else 'no'}{' (' + c['note'] + ')' if c['note'] else ''} |"
        )
    base_run, cand_run = sheet["baseline_run"], sheet["candidate_run"]
    # Both runs' speculation tables, or neither: a baseline without it shows what it is compared with.
    speculation = shows_speculation({**base_run, "metrics": sheet["baseline"]},
                                    {**cand_run, "metrics": sheet["candidate"]})
    parts += ["", f"- {wall_time_ratio(base_run, cand_run)}"]
    for name, run, summary in (("baseline", base_run, sheet["baseline"]),
                               ("candidate", cand_run, sheet["candidate"])):
        parts += ["", f"## {name.capitalize()} ({sheet['parameter']} = {sheet[f'{name}_value']})", ""]
        parts += [run_line(name, run), "", metrics_markdown(summary)]
        parts += speculation_section(summary) if speculation else []
    parts.append("")
    parts += ["## Inventory", "", inventory_markdown(sheet["inventory"]), ""]
    return "\n".join(parts)
