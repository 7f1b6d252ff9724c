"""The GPU check's Markdown: one table per stage in the formats of docs/benchmarks/results.md, the stages'
outcomes, and the device inventory. Reads only the JSON-able report that bench/gpu_check.py writes beside
it."""

from __future__ import annotations

from typing import Any

from conveyor.bench.report import fmt

# The rows of docs/benchmarks/results.md, in its order.
SYSTEM_LABELS = {
    "engine": "Conveyor engine",
    "hf-cb": "transformers continuous batching (`hf-cb`)",
    "hf-static": "transformers static `generate` (`hf-static`)",
}


def report_markdown(report: dict[str, Any]) -> str:
    stages = {s["name"]: s for s in report["stages"]}
    parts = [
        f"# {report['title']}",
        "",
        f"`{report['command']}`: **{'passed' if report['ok'] else 'FAILED'}** in {report['seconds']:.0f} s "
        f"(budget {report['budget_s']:.0f} s).",
        "",
        inventory_line(report["inventory"]),
        "",
        stages_table(report["stages"]),
    ]
    sections = {"kernels": kernel_section, "quant": quant_section, "speculation": speculation_section,
                "engine": engine_section, "moe": engine_section, "service": service_section}
    for name, section in sections.items():
        figures = stages.get(name, {}).get("figures")
        if figures and figures.get("problems") is not None:
            parts += ["", section(figures)]
    return "\n".join(parts) + "\n"


def inventory_line(inv: dict[str, Any]) -> str:
    device = inv["device"]
    memory = f", {device['memory_bytes'] / 2**30:.0f} GiB" if device.get("memory_bytes") else ""
    cuda = inv.get("cuda_version") or "none"
    return (
        f"Device: {device['name']}{memory}; torch {inv['torch_version']} (CUDA {cuda}), "
        f"triton {inv.get('triton_version') or 'none'}, transformers {inv.get('transformers_version')}, "
        f"Python {inv['python_version']}; commit `{inv.get('git_commit') or 'unknown'}`; recorded "
        f"{inv['recorded_at']}."
    )


def stages_table(stages: list[dict[str, Any]]) -> str:
    lines = ["| stage | status | time | budget | note |", "|---|---|---|---|---|"]
    for s in stages:
        note = (s.get("error") or "").replace("|", "\\|").replace("\n", " ")
        lines.append(
            f"| {s['name']} | {s['status']} | {s['seconds']:.1f} s | {s['budget_s']:.0f} s | {note} |"
        )
    return "\n".join(lines)


def kernel_section(k: dict[str, Any]) -> str:
    shape, copy = k["shape"], k["copy"]
    spec = f"; the spec sheet's peak is {k['peak_gbps']:.0f} GB/s" if k.get("peak_gbps") else ""
    lines = [
        f"## Kernels: Triton paged attention ({shape['dtype']}, Hq={shape['num_heads']}, "
        f"Hkv={shape['num_kv_heads']}, D={shape['head_dim']}, block size {shape['block_size']})",
        "",
        f"Device-to-device copy of {copy['bytes'] / 2**20:.0f} MiB: **{copy['gbps']:.0f} GB/s** (read + "
        f"write, {copy['timing']} timing){spec}. GB/s count each K/V row, q and the output once; `of copy` "
        "is that against the measured copy; `vs SDPA` > 1: the paged kernel is faster than SDPA on "
        "contiguous copies.",
        "",
        "| case | tokens | splits | max err | ok | Triton ms | TFLOP/s | GB/s | of copy | SDPA ms "
        "| vs SDPA |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in k["cases"]:
        cells = [
            c["case"],
            str(c["tokens"]),
            str(c["splits"]),
            f"{c['max_err']:.1e}",
            "yes" if c["ok"] else "**NO**",
            f"{fmt(c['triton_ms'])} ({c['timing']})",
            fmt(c["tflops"]),
            fmt(c["gbps"]),
            fmt(c["of_copy"], share=True),
            fmt(c["sdpa_ms"]),
            f"{c['sdpa_ms'] / c['triton_ms']:.2f}x",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def quant_section(q: dict[str, Any]) -> str:
    lines = [
        f"## Quantized weights: the Triton int8/int4 matmul ({q['dtype']} activations)",
        "",
        "Against the reference (dequantize, then multiply in fp32) and timed against the dense matmul of the "
        "same weight in the activations' dtype; `vs dense` > 1: the quantized kernel is faster.",
        "",
        "| case | max err | ok | quantized ms | dense ms | vs dense |",
        "|---|---|---|---|---|---|",
    ]
    for c in q["cases"]:
        ok = "yes" if c["ok"] else "**NO**"
        lines.append(f"| {c['case']} | {c['max_err']:.1e} | {ok} | {fmt(c['ms'])} ({c['timing']}) | "
                     f"{fmt(c['dense_ms'])} | {c['dense_ms'] / c['ms']:.2f}x |")
    return "\n".join(lines)


def speculation_section(s: dict[str, Any]) -> str:
    lines = [
        f"## Speculative decoding: `{s['model']}`, {s['requests']} requests, suffix drafts against none",
        "",
        "The bench's `quoting` prompts, each answered greedily and by a seeded sample (fp32); every answer's "
        f"tokens must be equal with and without drafts: {'they are' if s['ok'] else '**they are NOT**'}.",
        "",
        "| run | output tokens | seconds | tokens/s | drafted | accepted |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("plain", "suffix"):
        r = s[name]
        lines.append(f"| {name} | {r['output_tokens']} | {r['seconds']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['drafted_tokens']} | {r['accepted_tokens']} |")
    lines += ["", f"Speed-up (tokens/s, suffix / plain): {s['speedup']:.2f}x."]
    return "\n".join(lines)


def engine_section(e: dict[str, Any]) -> str:
    m = e["model"]
    lines = [
        f"## Engine against transformers: `{m['preset']}`, {parameters_text(m['parameters'])} parameters",
        "",
        f"Hidden {m['hidden']}, {m['layers']} layers, {m['heads']} query / {m['kv_heads']} KV heads "
        f"(head_dim {m['head_dim']}), intermediate {m['intermediate']}, vocabulary {m['vocab']}, random "
        "weights. "
        f"Workload: {e['workload']}.",
        "",
        "```bash",
        e["command"],
        "```",
        "",
        "| system | wall time | output tok/s | total tok/s | TTFT p50 / p90 | end-to-end p90 | engine is |",
        "|---|---|---|---|---|---|---|",
    ]
    known = [n for n in SYSTEM_LABELS if n in e["systems"]]
    for name in [*known, *(n for n in e["systems"] if n not in SYSTEM_LABELS)]:
        s = e["systems"][name]
        cells = [
            SYSTEM_LABELS.get(name, name),
            f"{s['wall_s']:.1f} s",
            _bold_if(fmt(s["output_tokens_per_s"]), name == "engine"),
            fmt(s["total_tokens_per_s"]),
            f"{_seconds(s['ttft_p50_s'])} / {_seconds(s['ttft_p90_s'])}",
            _seconds(s["e2e_p90_s"]),
            _engine_is(e["ratios"].get(f"engine / {name}")) if name != "engine" else "—",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def service_section(s: dict[str, Any]) -> str:
    f = s["service"]
    sub, svc = f["submit_latency_s"], f["service_time_s"]
    return "\n".join(
        [
            f"## Service: `conveyor serve` (embedded, SQLite), model: {s['model']}",
            "",
            "```bash",
            s["command"],
            "```",
            "",
            "| mode | done/s | submit p50 / p99 | service time p50 / p99 | succeeded / submitted |",
            "|---|---|---|---|---|",
            f"| embedded (`conveyor serve`, SQLite) | **{f['completions_per_s']:.1f}** | {_ms(sub['p50'])} / "
            f"{_ms(sub['p99'])} ms | {_ms(svc['p50'])} / {_ms(svc['p99'])} ms | "
            f"{f['succeeded']} / {f['submitted']} |",
        ]
    )


def parameters_text(count: int) -> str:
    if count >= 1e9:
        return f"{count / 1e9:.2f} B"
    return f"{count / 1e6:.1f} M" if count >= 1e6 else f"{count / 1e3:.0f} K"


def _engine_is(ratio: float | None) -> str:
    if not ratio:
        return "n/a"
    return f"**{ratio:.2f}x** faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} s"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{1e3 * value:.0f}"


def _bold_if(text: str, bold: bool) -> str:
    return f"**{text}**" if bold else text
