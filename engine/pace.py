"""How fast the engine goes at its current load, for a request's slack (deadline minus the time it still
needs): seconds per step, in which every running request gets one output token, and seconds per prompt token
prefilled. Measured as moving averages over the steps that computed something; the service's workers publish
them (core/store/workers.py) so that submit can predict run and finish times too."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.engine.stats import StepStats

SMOOTHING = 0.1  # weight of the newest step in the moving averages (about the last 20 steps count)


@dataclass(frozen=True)
class Pace:
    """Zero: not measured yet (every request then has its whole deadline as slack: earliest deadline
    first)."""

    step_s: float = 0.0  # seconds per engine step
    prefill_token_s: float = 0.0  # seconds per prompt token computed

    def remaining_s(self, prefill_tokens: int, output_tokens: int) -> float:
        """Seconds to prefill `prefill_tokens` and then write up to `output_tokens`, one per step."""
        return prefill_tokens * self.prefill_token_s + output_tokens * self.step_s

    def to_json(self) -> dict[str, float]:
        return {"step_s": self.step_s, "prefill_token_s": self.prefill_token_s}


class PaceMeter:
    def __init__(self) -> None:
        self._step_s = 0.0
        self._prefill_token_s = 0.0

    def observe(self, step: StepStats) -> None:
        tokens = step.prefill_tokens + step.decode_tokens
        if tokens == 0:
            return  # an idle step (or one whose work all failed) says nothing about speed
        self._step_s = _average(self._step_s, step.step_seconds)
        if step.prefill_tokens:  # a mixed step's time is shared by its tokens, prompt or output
            self._prefill_token_s = _average(self._prefill_token_s, step.step_seconds / tokens)

    @property
    def pace(self) -> Pace:
        return Pace(self._step_s, self._prefill_token_s)


def _average(current: float, sample: float) -> float:
    return sample if current == 0.0 else current + SMOOTHING * (sample - current)
