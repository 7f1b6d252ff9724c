"""OpenAI's `service_tier` on the chat and completion routes and in batch lines, mapped onto a job's urgency:
`priority` goes ahead of the default tier, `flex` runs on spare capacity (after every other job of its
queue, first preempted, with no default deadline); `auto` and `default` change nothing. An explicit
`priority` field wins over the tier's. The answer echoes the tier asked for, as OpenAI's does."""

from __future__ import annotations

from typing import Literal

ServiceTier = Literal["auto", "default", "flex", "priority"]
TIER_PRIORITY: dict[str, int] = {"priority": -1, "flex": 1}  # lower is served first; the default tier is 0


def tier_priority(tier: ServiceTier | None, priority: int | None) -> int | None:
    """The job's priority: the one sent, else the tier's (None: the default, 0)."""
    return priority if priority is not None else TIER_PRIORITY.get(tier or "default")


def takes_default_deadline(tier: ServiceTier | None) -> bool:
    """Whether the queue's default_deadline_s applies: not to flex work, which waits for spare capacity."""
    return tier != "flex"
