"""Approval conditions and the decision sheet of a one-parameter experiment.

A condition is `GROUP.METRIC OP RHS`:
- GROUP: a group of the workload (`interactive`, `documents`, a trace's own) or `all`;
- METRIC: any scalar of the per-group metrics (`completed`, `failed`, `deadline_attainment`,
  `output_tokens_per_s`, `total_tokens_per_s`, `preemptions`, `peak_kv_usage`, `kv_waste`, `peak_running`,
  `drafted_tokens`, `accepted_tokens`, `acceptance_rate`, ...) or a latency percentile written
  `LATENCY_pNN` with NN in 50, 90, 95, 99 (`ttft_p95`, `e2e_p99`, `queue_time_p50`, `itl_p90`);
- OP: `<=`, `>=`, `<`, `>`, `==`;
- RHS: a number, `baseline` (the same figure in the baseline run), or `baseline*FACTOR`
  (e.g. `all.output_tokens_per_s>=baseline*1.1`).
The change is approved when every condition holds for the candidate run. A figure that is missing (no
completed request in the group) fails its condition, with that reason.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "==": operator.eq,
    "<": operator.lt,
    ">": operator.gt,
}
_PATTERN = re.compile(
    r"^\s*(?P<group>[\w-]+)\.(?P<metric>\w+)\s*(?P<op><=|>=|==|<|>)\s*"
    r"(?P<rhs>baseline(?:\s*\*\s*[0-9.eE+-]+)?|[0-9.eE+-]+)\s*$"
)
_PERCENTILE = re.compile(r"^(?P<latency>queue_time|ttft|itl|e2e)_(?P<p>p\d+)$")
DEFAULT_CONDITIONS = ("all.completed>=baseline", "all.deadline_attainment>=baseline")


def default_conditions(with_deadlines: bool) -> tuple[str, ...]:
    """Without a deadline in any group there is no attainment figure, and a missing figure fails its
    condition: such a workload is judged on completions alone."""
    return DEFAULT_CONDITIONS if with_deadlines else DEFAULT_CONDITIONS[:1]


@dataclass(frozen=True)
class Condition:
    text: str
    group: str
    metric: str
    op: str
    factor: float | None  # RHS is baseline x factor when set
    value: float | None  # RHS is this number when set

    @classmethod
    def parse(cls, text: str) -> Condition:
        m = _PATTERN.match(text)
        if m is None:
            raise ValueError(
                f"approve: cannot read {text!r}; write GROUP.METRIC OP VALUE, e.g. "
                "'interactive.ttft_p90<=1.0' or 'documents.completed>=baseline'"
            )
        rhs = m["rhs"].replace(" ", "")
        if rhs.startswith("baseline"):
            factor = float(rhs.split("*", 1)[1]) if "*" in rhs else 1.0
            return cls(text.strip(), m["group"], m["metric"], m["op"], factor, None)
        return cls(text.strip(), m["group"], m["metric"], m["op"], None, float(rhs))

    def evaluate(
        self, candidate: dict[str, dict[str, Any]], baseline: dict[str, dict[str, Any]]
    ) -> dict[str, Any]:
        got = metric_value(candidate, self.group, self.metric)
        want = self.value
        if self.factor is not None:
            base = metric_value(baseline, self.group, self.metric)
            want = None if base is None else base * self.factor
        ok = got is not None and want is not None and OPS[self.op](got, want)
        reason = "" if got is not None and want is not None else "figure missing"
        return {"condition": self.text, "candidate": got, "threshold": want, "passed": ok, "note": reason}


def metric_value(summary: dict[str, dict[str, Any]], group: str, metric: str) -> float | None:
    if group not in summary:
        return None
    figures = summary[group]
    pm = _PERCENTILE.match(metric)
    if pm is not None:
        values = figures[f"{pm['latency']}_s"]
        if pm["p"] not in values:
            raise ValueError(f"approve: no percentile {pm['p']!r} in {metric!r}; measured: {sorted(values)}")
        return values[pm["p"]]
    if metric not in figures:
        raise ValueError(f"approve: unknown metric {metric!r}; known: {sorted(figures)} or LATENCY_pNN")
    value = figures[metric]
    return None if value is None else float(value)


def decide(
    conditions: list[Condition], candidate: dict[str, dict[str, Any]], baseline: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    checks = [c.evaluate(candidate, baseline) for c in conditions]
    return {"approved": all(c["passed"] for c in checks), "checks": checks}


def default_hypothesis(param: str, base_value: Any, new_value: Any, conditions: list[Condition]) -> str:
    wanted = " and ".join(c.text for c in conditions)
    return f"Changing {param} from {base_value} to {new_value} keeps or improves: {wanted}."
