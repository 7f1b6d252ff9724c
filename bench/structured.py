"""Structured outputs in the bench: which requests are constrained, to what, and what it cost.

`--structured-share F` constrains that share of the workload's requests (spread evenly over the request
order, the same ones in every round and every system) to BENCH_SCHEMA, an object of the kinds users ask for:
an enum, a bounded integer, a boolean, a short string and a small array. The others run unconstrained in
the same steps, so the report can show what constraining costs the step and what it costs the requests
that did not ask for it.
"""

from __future__ import annotations

import math
from typing import Any

from conveyor.bench.metrics import request_metrics
from conveyor.bench.records import RunResult
from conveyor.bench.workload import BenchRequest

STRUCTURED_SHARE = "structured_share"  # the option's name, also a --compare / --sweep parameter
BENCH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "status": {"enum": ["open", "closed", "pending"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "urgent": {"type": "boolean"},
        "title": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["status", "priority", "urgent", "title", "tags"],
    "additionalProperties": False,
}


def check_share(share: float) -> float:
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"structured_share (--structured-share): a share in [0, 1], got {share}")
    return share


def constrained_ids(requests: list[BenchRequest], share: float) -> set[str]:
    """Request i is constrained when floor((i + 1) * share) > floor(i * share): 0.5 takes every other one."""
    return {
        r.request_id for i, r in enumerate(requests) if math.floor((i + 1) * share) > math.floor(i * share)
    }


def structured_figures(result: RunResult) -> dict[str, Any] | None:
    """The constrained and the unconstrained requests of one run, each counted as the report counts a
    group (tokens/s over the whole run's wall time, so the two add up to the run's); None: none was."""
    if not any(r.constrained for r in result.records):
        return None
    return {
        "constrained": request_metrics(result, [r for r in result.records if r.constrained]),
        "unconstrained": request_metrics(result, [r for r in result.records if not r.constrained]),
    }
