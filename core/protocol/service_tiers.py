"""OpenAI's `service_tier` on the chat and completion routes and in batch lines, mapped onto a job's urgency:
`priority` goes ahead of the default tier, `flex` runs on spare capacity (after every other job of its
queue, first preempted, with no default deadline); `auto` and `default` change nothing. An explicit
`priority` field wins over the tier's. The answer echoes the tier asked for, as OpenAI's does.

A tenant may be held to a range of priorities (`conveyor tenants set T --min-priority 0`): a priority asked
for outside it, by the field or by the tier, is refused; a job that asks for none gets the default, 0,
brought inside the range.

Goodput (jobs with a deadline counted on time, late or missed) is reported per tier: `goodput_tier` names
the three that behave differently; no tier, `auto` and `default` are all the default tier."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ServiceTier = Literal["auto", "default", "flex", "priority"]
DEFAULT_PRIORITY = 0
TIER_PRIORITY: dict[str, int] = {"priority": -1, "flex": 1}  # lower is served first; the default tier is 0
GOODPUT_TIERS = ("default", "flex", "priority")  # the `tier` label of goodput (conveyor_job_deadlines_total)


def tier_priority(tier: ServiceTier | None, priority: int | None) -> int | None:
    """The job's priority: the one sent, else the tier's (None: the default, 0)."""
    return priority if priority is not None else TIER_PRIORITY.get(tier or "default")


class PriorityNotPermitted(ValueError):
    """A priority outside the tenant's range; `field` names what asked for it (priority or service_tier)."""

    def __init__(self, tier: str | None, priority: int | None, asked: int, allowed: PriorityRange) -> None:
        self.field = "priority" if priority is not None else "service_tier"
        what = f"priority: {asked}" if priority is not None else f"service_tier: {tier!r} (priority {asked})"
        super().__init__(f"{what} is outside the priorities this tenant may ask for, {allowed}")


@dataclass(frozen=True)
class PriorityRange:
    """The priorities a tenant may ask for, both ends included; None: unbounded on that side."""

    lowest: int | None = None  # the most urgent allowed (lower is served first)
    highest: int | None = None  # the least urgent allowed

    def job_priority(self, tier: ServiceTier | None, priority: int | None) -> int:
        """The job's priority. Raises ValueError, starting with the field that asked, when the priority asked
        for (by `priority`, else by the tier) is outside the range."""
        asked = tier_priority(tier, priority)
        if asked is None:
            return self._clamp(DEFAULT_PRIORITY)
        if self._clamp(asked) != asked:
            raise PriorityNotPermitted(tier, priority, asked, self)
        return asked

    def _clamp(self, priority: int) -> int:
        if self.lowest is not None:
            priority = max(priority, self.lowest)
        return min(priority, self.highest) if self.highest is not None else priority

    def __str__(self) -> str:
        lowest = "-inf" if self.lowest is None else str(self.lowest)
        return f"[{lowest}, {'inf' if self.highest is None else self.highest}]"


def takes_default_deadline(tier: ServiceTier | None) -> bool:
    """Whether the queue's default_deadline_s applies: not to flex work, which waits for spare capacity."""
    return tier != "flex"


def goodput_tier(service_tier: str | None) -> str:
    """The tier a job's goodput counts under: `flex`, `priority`, else `default` (no tier, `auto`, `default`,
    and anything unknown, so a label never takes a value outside GOODPUT_TIERS)."""
    return service_tier if service_tier in GOODPUT_TIERS else "default"
