"""The service figures of an HTTP run: how fast the API takes jobs and gets them done, and what it refused.

- submitted = succeeded + failed + refused + cancelled; *refused*: the API answered the submit with a 4xx or
  5xx (each is kept with its HTTP status, error code and message); *failed*: accepted but not succeeded
  (the job failed or expired, an HTTP error, or unfinished at the timeout).
- submit latency: POST /v1/jobs until its answer, timed on the client, over accepted submissions (a refusal
  is answered before any work would be done, so it would flatter the figure). On a machine the bench
  shares with the server it includes the bench's own scheduling delay.
- submit rate: accepted submissions / (last accepted answer - first submit).
- wall time: first submit to the last job's end (its `finished_at`, or the answer to its refusal);
  completions/s = succeeded / wall time.
- service time: `finished_at - created_at` of succeeded jobs, from the job's own timestamps, so waiting for
  the answer does not blur it; queue time likewise `started_at - created_at`.
- bench CPU: the bench's own CPU time during the run, in seconds and per submitted job: on a machine it
  shares with the server, this much was taken from the server.
- server CPU (bench/server_cpu.py): per server process tree given with --server-pid (API and worker apart,
  or the embedded service), CPU seconds in the run's window, ms per succeeded job, cores used and succeeded
  jobs/s per core used; `unknown` says why when not measured. `pinning`: the CPUs of the server and of the
  bench (bench/affinity.py), or why nothing was pinned.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from conveyor.bench.metrics import percentiles
from conveyor.bench.records import RequestRecord, RunResult
from conveyor.bench.server_cpu import server_figures

EXAMPLE_IDS = 5  # request ids named per kind of refusal


def service_figures(result: RunResult) -> dict[str, Any]:
    records = result.records
    accepted = [r for r in records if r.submit_status is not None and not r.refused]
    done = [r for r in records if r.status == "completed"]
    first = min((r.submit_time for r in records if r.submit_time is not None), default=None)
    wall = _since(first, max((r.finished_time for r in records if r.finished_time is not None), default=None))
    last_accepted = max((t for t in map(_answered, accepted) if t is not None), default=None)
    submit_span = _since(first, last_accepted)
    return {
        "submitted": len(records),
        "accepted": len(accepted),
        "succeeded": len(done),
        "failed": sum(r.status == "failed" and not r.refused for r in records),
        "refused": sum(r.refused for r in records),
        "cancelled": sum(r.status == "cancelled" for r in records),
        "wall_s": wall,
        "submit_rate_per_s": len(accepted) / submit_span if submit_span else None,
        "submit_latency_s": percentiles(r.submit_latency_s for r in accepted),
        "completions_per_s": len(done) / wall if wall else None,
        "service_time_s": percentiles(r.e2e for r in done),
        "queue_time_s": percentiles(r.queue_time for r in done),
        "client_cpu_s": result.client_cpu_s,
        "client_cpu_per_job_ms": _per_job_ms(result.client_cpu_s, len(records)),
        "refused_by_code": dict(Counter(r.error_code or "unknown" for r in records if r.refused)),
        "failed_by_code": dict(
            Counter(r.error_code or "unknown" for r in records if r.status == "failed" and not r.refused)
        ),
        "refusals": refusals(records),
        "server_cpu": server_figures(result.server, len(done)),
        "pinning": (result.server or {}).get("pinning"),
    }


def refusals(records: list[RequestRecord]) -> list[dict[str, Any]]:
    """One entry per distinct (HTTP status, error code, message), most frequent first."""
    kinds: dict[tuple[int, str, str], list[str]] = {}
    for r in records:
        if r.refused:
            assert r.submit_status is not None
            kind = (r.submit_status, r.error_code or "unknown", r.error or "")
            kinds.setdefault(kind, []).append(r.request_id)
    return [
        {"status": status, "code": code, "message": message, "count": len(ids), "examples": ids[:EXAMPLE_IDS]}
        for (status, code, message), ids in sorted(kinds.items(), key=lambda kv: -len(kv[1]))
    ]


def refusal_notes(records: list[RequestRecord]) -> list[str]:
    return [
        f"refused at submit, {k['count']} job(s): HTTP {k['status']} {k['code']}: {k['message']} "
        f"(e.g. {', '.join(k['examples'])})"
        for k in refusals(records)
    ]


def _per_job_ms(seconds: float | None, jobs: int) -> float | None:
    return None if seconds is None or not jobs else 1000 * seconds / jobs


def _answered(r: RequestRecord) -> float | None:
    """When the submit's answer came back."""
    if r.submit_time is None or r.submit_latency_s is None:
        return None
    return r.submit_time + r.submit_latency_s


def _since(t0: float | None, t1: float | None) -> float | None:
    return None if t0 is None or t1 is None else max(t1 - t0, 0.0)
