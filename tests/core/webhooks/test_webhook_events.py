from __future__ import annotations

from datetime import datetime, timezone

import pytest

from conveyor.core.webhooks.events import EVENT_TYPES, build_event, encode_event, matches, validate_filter


def test_event_types_are_the_documented_thirteen() -> None:
    assert set(EVENT_TYPES) == {"job.succeeded", "job.failed", "job.cancelled", "job.expired", "job.started",
                                "batch.completed", "batch.failed", "batch.cancelled", "batch.expired",
                                "response.completed", "response.incomplete", "response.failed",
                                "response.cancelled"}


@pytest.mark.parametrize(("patterns", "event_type", "wanted"), [
    ([], "batch.failed", True),
    (["*"], "job.expired", True),
    (["job.*"], "job.failed", True),
    (["job.*"], "batch.failed", False),
    (["job.succeeded", "batch.*"], "batch.cancelled", True),
    (["job.succeeded"], "job.failed", False),
    # job.started is opt-in: only a filter naming it gets it, so "*" and "job.*" mean what they meant before
    ([], "job.started", False),
    (["*"], "job.started", False),
    (["job.*"], "job.started", False),
    (["job.started"], "job.started", True),
    (["*"], "batch.expired", True),
    (["response.*"], "response.incomplete", True),
    (["job.*"], "response.completed", False),
])
def test_subscription_filter(patterns: list[str], event_type: str, wanted: bool) -> None:
    assert matches(patterns, event_type) is wanted


@pytest.mark.parametrize("pattern", ["job.done", "jobs.*", "job*", ""])
def test_unknown_filter_patterns_are_refused_by_name(pattern: str) -> None:
    with pytest.raises(ValueError, match=repr(pattern).replace("*", r"\*")):
        validate_filter(["job.*", pattern])


def test_event_body_is_compact_json_with_type_timestamp_and_data() -> None:
    event = build_event("job.succeeded", {"id": "job_1", "result": "héllo"},
                        datetime(2026, 11, 30, 5, 0, 1, tzinfo=timezone.utc))
    assert encode_event(event) == ('{"type":"job.succeeded","timestamp":"2026-11-30T05:00:01Z",'
                                   '"data":{"id":"job_1","result":"héllo"}}').encode()


def test_unknown_event_type_and_naive_time_are_refused() -> None:
    with pytest.raises(ValueError, match=r"job\.queued"):
        build_event("job.queued", {}, datetime.now(timezone.utc))
    with pytest.raises(ValueError, match="occurred_at"):
        build_event("job.failed", {}, datetime(2026, 1, 1))
