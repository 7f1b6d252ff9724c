from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime

import pytest

from conveyor.worker.webhooks.backoff import (
    JITTER,
    MAX_ATTEMPTS,
    MAX_RETRY_AFTER,
    RETRY_DELAYS,
    next_attempt_at,
    parse_retry_after,
    retry_delay,
)

NOW = datetime(2026, 11, 30, 5, 0, tzinfo=timezone.utc)
THREE_DAYS = timedelta(days=3).total_seconds()


def _schedule(seed: int) -> list[datetime]:
    """Due times of attempts 2..MAX_ATTEMPTS when every attempt fails at the moment it is due."""
    rng, due, times = random.Random(seed), NOW, []
    for attempt in range(1, MAX_ATTEMPTS + 1):
        next_due = next_attempt_at(attempt, now=due, rng=rng)
        if next_due is None:
            return times
        times.append(next_due)
        due = next_due
    raise AssertionError("the schedule never ran out")


def test_documented_schedule_adds_up_to_about_three_days() -> None:
    assert [d.total_seconds() for d in RETRY_DELAYS] == [5, 300, 1800, 7200, 18000, 36000, 36000, 50400,
                                                         50400, 57600]
    assert MAX_ATTEMPTS == 11
    assert sum(d.total_seconds() for d in RETRY_DELAYS) == pytest.approx(THREE_DAYS, rel=0.01)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_jittered_schedule_stays_in_bounds_and_totals_about_three_days(seed: int) -> None:
    times = _schedule(seed)
    assert len(times) == MAX_ATTEMPTS - 1
    previous = NOW
    for due, base in zip(times, RETRY_DELAYS, strict=True):
        gap = (due - previous).total_seconds()
        assert base.total_seconds() * (1 - JITTER) <= gap <= base.total_seconds() * (1 + JITTER)
        previous = due
    assert times == sorted(times)
    total = (times[-1] - NOW).total_seconds()
    assert THREE_DAYS * 0.85 <= total <= THREE_DAYS * 1.15


def test_jitter_comes_from_the_random_source() -> None:
    assert _schedule(7) == _schedule(7)
    assert _schedule(7) != _schedule(8)


def test_exhausted_after_the_last_attempt() -> None:
    assert next_attempt_at(MAX_ATTEMPTS, now=NOW, rng=random.Random(0)) is None
    assert retry_delay(MAX_ATTEMPTS - 1, random.Random(0)) is not None
    with pytest.raises(ValueError, match="attempt"):
        retry_delay(0, random.Random(0))


def test_retry_after_seconds_replaces_a_shorter_delay() -> None:
    wait = parse_retry_after("120", NOW)
    assert wait == timedelta(seconds=120)
    assert next_attempt_at(1, now=NOW, rng=random.Random(0), retry_after=wait) == NOW + wait


def test_retry_after_http_date_is_relative_to_now() -> None:
    header = format_datetime(NOW + timedelta(minutes=45), usegmt=True)
    wait = parse_retry_after(header, NOW)
    assert wait == timedelta(minutes=45)
    assert next_attempt_at(2, now=NOW, rng=random.Random(0), retry_after=wait) == NOW + timedelta(minutes=45)


def test_retry_after_shorter_than_the_schedule_is_ignored() -> None:
    scheduled = next_attempt_at(4, now=NOW, rng=random.Random(3))
    assert next_attempt_at(4, now=NOW, rng=random.Random(3), retry_after=timedelta(seconds=1)) == scheduled


def test_retry_after_is_capped() -> None:
    due = next_attempt_at(1, now=NOW, rng=random.Random(0), retry_after=timedelta(days=30))
    assert due == NOW + MAX_RETRY_AFTER


@pytest.mark.parametrize("header", [None, "", "soon", "-5"])
def test_unusable_retry_after_is_none(header: str | None) -> None:
    assert parse_retry_after(header, NOW) is None


def test_retry_after_date_in_the_past_is_zero() -> None:
    assert parse_retry_after(format_datetime(NOW - timedelta(hours=1), usegmt=True), NOW) == timedelta(0)
