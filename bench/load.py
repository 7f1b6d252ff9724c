"""`--load X`: Poisson arrivals at X times the engine's capacity, measured on the workload itself.

Before the measured runs the bench submits the workload's own requests all at once to an engine built with
the first arm's settings (a closed burst: the engine is saturated from its first step to its last) and
counts completed requests per second over the burst: the capacity. Each group's rate is then
X * capacity * its weight / the sum of the weights. The weights are the `--rate` values, read as shares
of the arrivals and not as requests/s, or, without `--rate`, the profile's mix (each group's share of the
requests, so that both groups arrive over the same span). The derived rates replace the spec's, so every
arm of `--compare` / `--sweep` runs the same arrivals (same seed).

Scaling every group's rate by one factor divides every arrival time by it and changes no other draw, so
the calibration burst holds exactly the prompts and lengths of the measured runs.

A trace has its own arrival times, so with a trace `--load X` needs no calibration: every arrival offset is
divided by X (X > 1 compresses the recorded traffic, X < 1 spreads it), in-process or over HTTP alike.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from conveyor.bench.workload import BenchRequest, WorkloadSpec

FLAG = "load (--load)"


@dataclass(frozen=True)
class LoadPlan:
    """The measured capacity, the multiple asked for and the per-group rates derived from them."""

    load: float
    capacity_rps: float  # completed requests/s of the calibration burst
    weights: dict[str, float]  # each group's share of the arrivals (sums to 1)
    rates: dict[str, float]  # requests/s per group: load * capacity * weight
    calibration_requests: int
    calibration_completed: int
    calibration_s: float
    arrival_span_s: float  # first to last arrival of the measured workload

    @property
    def offered_rps(self) -> float:
        return sum(self.rates.values())

    def describe(self) -> str:
        rates = ", ".join(f"{g} {r:.4g}/s" for g, r in self.rates.items())
        return (
            f"load {self.load:g}x the measured capacity of {self.capacity_rps:.4g} requests/s "
            f"({self.calibration_completed} of {self.calibration_requests} requests submitted at once, "
            f"completed in {self.calibration_s:.2f} s): {self.offered_rps:.4g} requests/s offered "
            f"({rates}), {self.calibration_requests} arrivals over {self.arrival_span_s:.2f} s"
        )

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "offered_rps": self.offered_rps}


def check_load(load: float | None, spec: WorkloadSpec, target: str, trace: str | None) -> None:
    """The multiple must be a finite number > 0; a profile's is of the capacity measured in-process (`--rate`
    then gives weights), a trace's divides its arrival times (any target)."""
    if load is None:
        return
    if not math.isfinite(load) or load <= 0:
        raise ValueError(f"{FLAG}: need a multiple > 0 (e.g. 1.5 or 0.5), got {load}")
    if trace:
        return
    if target != "engine":
        raise ValueError(f"{FLAG}: the capacity is measured in-process; it needs --target engine")
    mix_weights(spec)


def mix_weights(spec: WorkloadSpec) -> dict[str, float]:
    """Each group's share of the arrivals: the `--rate` values as weights, else each group's share of the
    profile's requests. Given weights must name every group, each > 0 (a rate of 0 would mean 'all at
    t=0', which no load multiple describes)."""
    names = [g.name for g in spec.groups()]
    if not spec.rates:
        return _normalised(_profile_mix(spec, names))
    missing = [n for n in names if n not in spec.rates]
    bad = [f"{g}={w:g}" for g, w in spec.rates.items() if not (math.isfinite(w) and w > 0)]
    if missing or bad:
        raise ValueError(
            f"{FLAG}: with --load, --rate gives each group's share of the arrivals (a weight, not "
            f"requests/s): give a weight > 0 for every group ({', '.join(names)}), or no --rate for the "
            "profile's mix"
            + (f"; missing {', '.join(missing)}" if missing else "")
            + (f"; not > 0: {', '.join(bad)}" if bad else "")
        )
    return _normalised({n: spec.rates[n] for n in names})


def _profile_mix(spec: WorkloadSpec, names: list[str]) -> dict[str, float]:
    if spec.profile in ("mixed", "deadlines"):
        return {spec.short_group: 1.0 - spec.documents_share, spec.long_group: spec.documents_share}
    return {n: 1.0 for n in names}


def _normalised(weights: Mapping[str, float]) -> dict[str, float]:
    total = sum(weights.values())
    return {g: w / total for g, w in weights.items()}


def scaled_rates(capacity_rps: float, load: float, weights: Mapping[str, float]) -> dict[str, float]:
    """Per group, requests/s summing to `load * capacity_rps`, split in proportion to `weights`."""
    if not (math.isfinite(capacity_rps) and capacity_rps > 0):
        raise ValueError(f"capacity: need a measured capacity > 0 requests/s, got {capacity_rps}")
    if not (math.isfinite(load) and load > 0):
        raise ValueError(f"{FLAG}: need a multiple > 0, got {load}")
    if any(not (math.isfinite(w) and w >= 0) for w in weights.values()):
        raise ValueError(f"weights: need finite weights >= 0, got {dict(weights)}")
    total = sum(weights.values())
    if total <= 0:
        raise ValueError(f"weights: need at least one weight > 0, got {dict(weights)}")
    offered = load * capacity_rps
    return {g: offered * w / total for g, w in weights.items()}


def burst(requests: Sequence[BenchRequest]) -> list[BenchRequest]:
    """The same requests, all arriving at t=0: the calibration run."""
    return [replace(r, arrival_s=0.0) for r in requests]


def scale_arrivals(requests: Sequence[BenchRequest], load: float) -> list[BenchRequest]:
    """A trace at `load` times its recorded pace: every arrival offset divided by it."""
    assert math.isfinite(load) and load > 0, "checked by check_load"
    return [replace(r, arrival_s=round(r.arrival_s / load, 6)) for r in requests]


def trace_load_record(load: float, requests: Sequence[BenchRequest]) -> dict[str, Any]:
    """What a report says of `--load` on a trace (a profile's: LoadPlan.record()): no capacity measured."""
    return {
        "load": load,
        "arrivals": f"the trace's arrival_s divided by {load:g}",
        "capacity_rps": None,
        "arrival_span_s": max((r.arrival_s for r in requests), default=0.0),
    }
