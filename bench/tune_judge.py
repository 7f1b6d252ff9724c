"""The tuner's objectives and its adoption rule, on the summaries of repeated runs.

Each configuration runs several times; noise is the spread (max - min) of the objective over one
configuration's repeats. A candidate is adopted when
- mean(candidate) - mean(current best) > the larger spread of the two, and
- every group with a deadline keeps its on-time share: candidate mean >= current mean - current spread.
Summaries are experiment.run_summary's: {"duration_s": ..., "metrics": {group: figures, "all": figures}}.
"""

from __future__ import annotations

from typing import Any

from conveyor.bench.metrics import ALL

# name -> (the figure of metrics["all"] it reads, what it is, for --help and the report); higher is better.
OBJECTIVES: dict[str, tuple[str, str]] = {
    "goodput": ("goodput_rps", "completed requests within their deadline per second of the run (one "
                "without a deadline counts once completed)"),
    "output_tokens_per_s": ("output_tokens_per_s", "output tokens of completed requests per second"),
    "on_time": ("deadline_attainment", "share of the requests with a deadline completed within it "
                "(cancelled ones left out)"),
}
ON_TIME = "deadline_attainment"  # a group's on-time share (bench/metrics.py)


def check_objective(objective: str) -> str:
    if objective not in OBJECTIVES:
        raise ValueError(f"objective: unknown {objective!r}; one of {', '.join(OBJECTIVES)}")
    return objective


def objective_value(summary: dict[str, Any], objective: str) -> float:
    metric = OBJECTIVES[objective][0]
    value = summary["metrics"][ALL].get(metric)
    if value is None:
        raise ValueError(f"objective {objective}: the run measured no {metric} (no request with a deadline, "
                         "or a bench without the figure); choose another --objective")
    return float(value)


def mean(values: list[float]) -> float:
    assert values, "a mean of no runs"
    return sum(values) / len(values)


def spread(values: list[float]) -> float:
    assert values, "a spread of no runs"
    return max(values) - min(values)


def mean_summary(summaries: list[Any]) -> Any:
    """The summaries' shape with each number the mean over them (None where none has one; an int where the
    mean is whole); other values (text, lists) the first's. Counts become means: 7.5 completed over two."""
    first = summaries[0]
    if isinstance(first, dict):
        return {k: mean_summary([s.get(k) if isinstance(s, dict) else None for s in summaries])
                for k in first}
    if _number(first) or first is None:
        numbers = [s for s in summaries if _number(s)]
        if not numbers:
            return None
        average = mean([float(n) for n in numbers])
        whole = all(isinstance(n, int) for n in numbers) and average.is_integer()
        return int(average) if whole else average
    return first


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def deadline_groups(summaries: list[dict[str, Any]]) -> list[str]:
    """The groups (not "all") whose on-time share the current best's runs measured."""
    return sorted({g for s in summaries for g, m in s["metrics"].items()
                   if g != ALL and m.get(ON_TIME) is not None})


def judge(objective: str, current: list[dict[str, Any]], candidate: list[dict[str, Any]]) -> dict[str, Any]:
    """The decision on a candidate against the current best, in decision.py's shape ("approved", "checks"
    with condition, candidate, threshold, passed, note) plus the figures behind it and a one-line reason."""
    cur = [objective_value(s, objective) for s in current]
    cand = [objective_value(s, objective) for s in candidate]
    gain, noise = mean(cand) - mean(cur), max(spread(cur), spread(cand))
    checks = [{
        "condition": f"mean {objective} gain over the current best > the noise (the larger spread, max - min "
                     "over a configuration's repeats)",
        "candidate": gain, "threshold": noise, "passed": gain > noise, "note": "",
    }]
    checks += [_share_check(g, current, candidate) for g in deadline_groups(current)]
    approved = all(c["passed"] for c in checks)
    return {
        "approved": approved,
        "checks": checks,
        "objective": objective,
        "current": {"values": cur, "mean": mean(cur), "spread": spread(cur)},
        "candidate": {"values": cand, "mean": mean(cand), "spread": spread(cand)},
        "gain": gain,
        "noise": noise,
        "reason": _reason(approved, gain, noise, checks[1:]),
    }


def _share_check(group: str, current: list[dict[str, Any]], candidate: list[dict[str, Any]]
                 ) -> dict[str, Any]:
    cur, cand = _shares(group, current), _shares(group, candidate)
    threshold = mean(cur) - spread(cur)
    got = mean(cand) if cand else None
    return {
        "condition": f"{group} on-time share (mean) >= the current best's mean - its spread",
        "candidate": got, "threshold": threshold, "passed": got is not None and got >= threshold,
        "note": "" if got is not None else "figure missing",
    }


def _shares(group: str, summaries: list[dict[str, Any]]) -> list[float]:
    return [m[ON_TIME] for s in summaries if (m := s["metrics"].get(group)) and m.get(ON_TIME) is not None]


def _reason(approved: bool, gain: float, noise: float, share_checks: list[dict[str, Any]]) -> str:
    if approved:
        return f"gain {gain:.4g} beyond the noise {noise:.4g}, every deadline group kept its on-time share"
    if gain < -noise:
        return f"worse: {-gain:.4g} lower, beyond the noise {noise:.4g}"
    if gain <= noise:
        return f"gain {gain:.4g} within the noise {noise:.4g}"
    broken = [c["condition"].split(" ", 1)[0] for c in share_checks if not c["passed"]]
    return f"gain {gain:.4g} beyond the noise {noise:.4g}, but the on-time share fell in {', '.join(broken)}"
