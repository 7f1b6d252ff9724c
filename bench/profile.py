"""What a step spends its time on: torch.profiler over engine steps of the same workload.

All requests are added at once; the first steps (prefill) run unprofiled until the running set is as full
as it will get, then `steps` steps are profiled. The full operator table goes to a text file; the top
operators by self CPU time (with their share) go into the report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.profiler import ProfilerActivity, profile, record_function

from conveyor.bench.offline import bench_params
from conveyor.bench.workload import BenchRequest


def profile_steps(
    engine: Any, requests: list[BenchRequest], opts: Any, out: Path, top: int = 12
) -> dict[str, Any]:
    steps = int(opts.torch_profile_steps)
    for req in requests:
        prompt = req.prompt if req.prompt is not None else list(req.prompt_token_ids or [])
        engine.add_request(
            f"profile-{req.request_id}", prompt, bench_params(req, opts.respect_eos), req.group
        )
    _until_full(engine)
    batch = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            if not engine.has_unfinished_requests():
                break
            with record_function("engine.step"):
                engine.step()
            batch.append(engine.last_step.num_seqs)
    for request_id in [f"profile-{r.request_id}" for r in requests]:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    averages = prof.key_averages()
    out.write_text(averages.table(sort_by="self_cpu_time_total", row_limit=40))
    total = sum(e.self_cpu_time_total for e in averages) or 1.0
    ranked = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {
        "steps": len(batch),
        "mean_batch": sum(batch) / max(len(batch), 1),
        "table": str(out),
        "top_self_cpu": [
            {
                "op": e.key,
                "self_cpu_s": e.self_cpu_time_total / 1e6,
                "share": e.self_cpu_time_total / total,
                "calls": e.count,
            }
            for e in ranked
        ],
    }


def _until_full(engine: Any, max_steps: int = 10_000) -> None:
    """Steps until every admitted request is past its prefill (a pure-decode batch, as big as it gets)."""
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return
        engine.step()
        stats = engine.last_step
        if stats.prefill_tokens == 0 and stats.num_seqs > 0:
            return
