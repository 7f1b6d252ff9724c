"""One counting rule for every target and configuration, per group and for all groups together.

- submitted = every request of the workload; each ends in exactly one of completed (finished with `stop` or
  `length`; over HTTP `succeeded`), cancelled (the bench cancelled it and the target confirmed it), failed
  (anything else: refused at submit, error, expired, or unfinished when the run's timeout hit).
- Latency percentiles (queue time, TTFT, inter-token latency, end-to-end) cover completed requests only and
  are measured from the client's arrival time (run start + arrival offset), not from when the target saw it.
  Inter-token latency is each request's mean gap after the first token; percentiles are over requests.
- A request's deadline is its own (`deadline_s`, as an exported trace's job had it) when it has one, else
  its group's; it is measured from the request's arrival.
- Deadline attainment = completed within their deadline / (submitted - cancelled), over the requests that
  have a deadline (None when none has).
- `on_time` = completed requests within their deadline, a completed request without any deadline counting
  as on time; `goodput_rps` = on_time / the run's wall time: completed useful responses per second, the
  figure the tuner's objective reads (metrics["all"]["goodput_rps"]).
- Tokens/s count completed requests only (cancelled work is not useful), over the run's wall time.
- KV waste = (allocated slots - stored tokens) / allocated slots, summed over every step (so it is weighted by
  how long and how much memory was held); `kv_waste_peak` is the worst single step.
- Speculative decoding: drafted and accepted tokens summed over every request of the group, whatever its end,
  and acceptance rate = accepted / drafted (None when nothing was drafted); bench/speculation.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from conveyor.bench.records import RequestRecord, RunResult, StepSample
from conveyor.bench.speculation import group_figures

PERCENTILES = (50, 90, 95, 99)
LATENCIES = ("queue_time", "ttft", "itl", "e2e")
ALL = "all"


def percentiles(values: Iterable[float | None]) -> dict[str, float | None]:
    xs = [v for v in values if v is not None]
    if not xs:
        return {f"p{p}": None for p in PERCENTILES}
    qs = np.percentile(np.asarray(xs, dtype=np.float64), PERCENTILES)
    return {f"p{p}": float(q) for p, q in zip(PERCENTILES, qs, strict=True)}


def summarize(result: RunResult, deadlines: dict[str, float]) -> dict[str, dict[str, Any]]:
    """{group: metrics} for every group present, plus "all". `deadlines`: per group, the deadline of its
    requests that have none of their own."""
    groups = sorted({r.group for r in result.records})
    out = {
        g: _group_metrics(result, g, [r for r in result.records if r.group == g], deadlines) for g in groups
    }
    out[ALL] = _group_metrics(result, None, result.records, deadlines)
    return out


def _group_metrics(
    result: RunResult, group: str | None, records: list[RequestRecord], deadlines: dict[str, float]
) -> dict[str, Any]:
    done = [r for r in records if r.status == "completed"]
    counts = {s: sum(r.status == s for r in records) for s in ("completed", "cancelled", "failed")}
    assert sum(counts.values()) == len(records), "every request ends in exactly one state"
    m: dict[str, Any] = {"submitted": len(records), **counts}
    for name in LATENCIES:
        m[f"{name}_s"] = percentiles(getattr(r, name) for r in done)
    m["deadline_s"] = deadlines.get(group) if group is not None else None
    m["deadline_attainment"] = _attainment(records, deadlines)
    m["on_time"] = sum(_on_time(r, _deadline(r, deadlines)) for r in done)
    m["goodput_rps"] = m["on_time"] / result.duration_s
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    m["output_tokens"] = output_tokens
    m["prompt_tokens"] = prompt_tokens
    m["output_tokens_per_s"] = output_tokens / result.duration_s
    m["total_tokens_per_s"] = (output_tokens + prompt_tokens) / result.duration_s
    m["preemptions"] = sum(r.num_preemptions for r in records)
    m.update(group_figures(records))
    m.update(_memory_metrics(result.samples, group))
    return m


def request_metrics(result: RunResult, records: list[RequestRecord]) -> dict[str, Any]:
    """Any subset of a run's requests counted as a group is (their own deadlines only; whole-run KV)."""
    return _group_metrics(result, None, records, {})


def full_batch_decode_steps(samples: list[StepSample]) -> dict[str, Any] | None:
    """Wall time of the pure decode steps (one token per sequence) at the largest batch any of them had:
    the figure a per-row cost (sampling, grammar masks) shows in, compared at the same batch size."""
    decodes = [s for s in samples if s.num_seqs > 0 and s.num_tokens == s.num_seqs]
    if not decodes:
        return None
    batch = max(s.num_seqs for s in decodes)
    times = [s.step_s for s in decodes if s.num_seqs == batch]
    return {"batch": batch, "steps": len(times), "mean_s": float(np.mean(times)), **percentiles(times)}


def _deadline(record: RequestRecord, deadlines: dict[str, float]) -> float | None:
    """The request's own deadline, else its group's (None: it has none)."""
    return record.deadline_s if record.deadline_s is not None else deadlines.get(record.group)


def _on_time(record: RequestRecord, deadline: float | None) -> bool:
    """Completed within its deadline (any completion, without one)."""
    if record.status != "completed":
        return False
    return deadline is None or (record.e2e is not None and record.e2e <= deadline)


def _attainment(records: list[RequestRecord], deadlines: dict[str, float]) -> float | None:
    """Completed within their deadline / those not cancelled, over the requests that have a deadline."""
    judged = [(r, _deadline(r, deadlines)) for r in records if r.status != "cancelled"]
    eligible = [(r, d) for r, d in judged if d is not None]
    if not eligible:
        return None
    return sum(_on_time(r, d) for r, d in eligible) / len(eligible)


def _memory_metrics(samples: list[StepSample], group: str | None) -> dict[str, Any]:
    running = [_pick(s.running, group) for s in samples]
    allocated = [_pick(s.kv_allocated_slots, group) for s in samples]
    stored = [_pick(s.kv_stored_tokens, group) for s in samples]
    usage = [
        s.kv_used_blocks / s.kv_total_blocks
        for s in samples
        if s.kv_used_blocks is not None and s.kv_total_blocks
    ]
    wastes = [(a - t) / a for a, t in zip(allocated, stored, strict=True) if a > 0]
    total_alloc = sum(allocated)
    return {
        "peak_running": max(running, default=None),  # None: the target exposes no running counts
        # KV memory is shared by all groups: the group's own share of the cache at its peak.
        "peak_kv_usage": _peak_group_usage(samples, group) if group else max(usage, default=None),
        "kv_waste": (total_alloc - sum(stored)) / total_alloc if total_alloc else None,
        "kv_waste_peak": max(wastes, default=None),
    }


def _peak_group_usage(samples: list[StepSample], group: str) -> float | None:
    shares = [
        s.kv_allocated_slots.get(group, 0) / (s.kv_total_blocks * s.kv_block_size)
        for s in samples
        if s.kv_total_blocks and s.kv_block_size
    ]
    return max(shares, default=None)


def _pick(per_group: dict[str, int], group: str | None) -> int:
    return sum(per_group.values()) if group is None else per_group.get(group, 0)


def count_check(summary: dict[str, dict[str, Any]]) -> bool:
    """completed + cancelled + failed = submitted in every group, and the groups add up to "all"."""
    groups = [g for g in summary if g != ALL]
    each = all(m["completed"] + m["cancelled"] + m["failed"] == m["submitted"] for m in summary.values())
    return each and sum(summary[g]["submitted"] for g in groups) == summary[ALL]["submitted"]
