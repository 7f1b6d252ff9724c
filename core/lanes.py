"""A lane: one model's one queue, the unit jobs are queued, claimed, counted and scaled by.

A lane's name is `MODEL:QUEUE` (`small:interactive`). It names the broker queue the lane's jobs are
published to, and it is what the store keeps in a job's `queue` column, so that every per-queue read and
index of the store (claims, fair share, tallies, outcome counts) is per model too. Queue names may not hold
the separator; model ids may (`llama3:8b`), so a lane splits at its last one.
"""

from __future__ import annotations

LANE_SEPARATOR = ":"
LANE_MAX_CHARS = 64  # the store's queue columns


def lane_of(model_id: str, queue: str) -> str:
    assert LANE_SEPARATOR not in queue, queue
    return f"{model_id}{LANE_SEPARATOR}{queue}"


def split_lane(lane: str) -> tuple[str, str]:
    """(model id, queue name) of a lane. A bare queue name (a row written by a release before lanes, while a
    rollout still ran one: docs/operations/upgrades.md) reads as ("", name): shown, never taken for a
    model."""
    model_id, _separator, queue = lane.rpartition(LANE_SEPARATOR)
    return model_id, queue


def queue_of(lane: str) -> str:
    return split_lane(lane)[1]


def model_of(lane: str) -> str:
    return split_lane(lane)[0]


def describe_lane(lane: str) -> str:
    """A lane as a message names it: `documents queue of model small`."""
    model_id, queue = split_lane(lane)
    return f"{queue} queue of model {model_id}"
