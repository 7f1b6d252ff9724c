"""Anthropic's Message Batches objects rendered from Conveyor's batches (core/views/message_batch_objects.py):
the ids, processing_status, request_counts (all `processing` until the batch ends, then summing to its
requests), the RFC 3339 times, and each kind of result line."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from conveyor.core.lifecycle import (
    BATCH_CANCELLED,
    BATCH_EXPIRED,
    BATCH_FAILED,
    CANCELLING,
    COMPLETED,
    FINALIZING,
    IN_PROGRESS,
    STOP_EXPIRED,
    STOP_FAILED,
    VALIDATING,
)
from conveyor.core.store.tables import Batch
from conveyor.core.views.message_batch_objects import (
    batch_id_of,
    message_batch,
    message_batch_id_of,
    request_counts,
    rfc3339,
    succeeded_line,
    unsucceeded_line,
)

CREATED = datetime(2026, 12, 6, 13, 0, 0, 250000, tzinfo=timezone.utc)
RESULTS = "http://localhost/v1/messages/batches/msgbatch_abc/results"


def _batch(status: str, *, requests: int = 10, completed: int = 0, failed: int = 0, cancelled: int = 0,
           stop_reason: str | None = None, **times: Any) -> Batch:
    return Batch(id="batch_abc", status=status, request_count=requests, total=completed + failed + cancelled,
                 completed=completed, failed=failed, cancelled=cancelled, stop_reason=stop_reason,
                 created_at=CREATED, expires_at=CREATED + timedelta(hours=24), **times)


def test_ids_map_both_ways_and_other_ids_name_no_message_batch() -> None:
    assert message_batch_id_of("batch_0123abcd") == "msgbatch_0123abcd"
    assert batch_id_of("msgbatch_0123abcd") == "batch_0123abcd"
    assert batch_id_of("batch_0123abcd") is None and batch_id_of("msg_0123") is None


@pytest.mark.parametrize(("status", "shown"), [
    (VALIDATING, "in_progress"), (IN_PROGRESS, "in_progress"), (FINALIZING, "in_progress"),
    (CANCELLING, "canceling"), (COMPLETED, "ended"), (BATCH_FAILED, "ended"), (BATCH_EXPIRED, "ended"),
    (BATCH_CANCELLED, "ended"),
])
def test_processing_status(status: str, shown: str) -> None:
    assert message_batch(_batch(status), RESULTS)["processing_status"] == shown


def test_every_request_is_processing_until_the_batch_ends() -> None:
    running = _batch(IN_PROGRESS, requests=10, completed=4, failed=1)
    assert request_counts(running) == {"processing": 10, "succeeded": 0, "errored": 0, "canceled": 0,
                                       "expired": 0}
    assert request_counts(_batch(CANCELLING, requests=10, completed=4, cancelled=2))["processing"] == 10


def test_ended_counts_sum_to_the_requests() -> None:
    completed = _batch(COMPLETED, requests=50, completed=48, failed=2)
    assert request_counts(completed) == {"processing": 0, "succeeded": 48, "errored": 2, "canceled": 0,
                                         "expired": 0}
    cancelled = _batch(BATCH_CANCELLED, requests=200, completed=7, failed=1, cancelled=192)
    assert request_counts(cancelled) == {"processing": 0, "succeeded": 7, "errored": 1, "canceled": 192,
                                         "expired": 0}
    # Stopped by the end of its window: what it never finished expired.
    expired = _batch(BATCH_EXPIRED, requests=20, completed=5, cancelled=15, stop_reason=STOP_EXPIRED)
    assert request_counts(expired) == {"processing": 0, "succeeded": 5, "errored": 0, "canceled": 0,
                                       "expired": 15}
    # Given up on before its input was all read: the lines never read are errored too.
    given_up = _batch(BATCH_FAILED, requests=30, completed=3, failed=1, stop_reason=STOP_FAILED)
    assert sum(request_counts(given_up).values()) == 30 and request_counts(given_up)["errored"] == 27


def test_the_object_in_anthropics_shape_with_its_results_url_once_ended() -> None:
    running = message_batch(_batch(IN_PROGRESS), RESULTS)
    assert running == {
        "id": "msgbatch_abc", "type": "message_batch", "processing_status": "in_progress",
        "request_counts": {"processing": 10, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0},
        "ended_at": None, "created_at": "2026-12-06T13:00:00.250000Z",
        "expires_at": "2026-12-07T13:00:00.250000Z", "cancel_initiated_at": None, "archived_at": None,
        "results_url": None,
    }
    cancel = CREATED + timedelta(minutes=1)
    ended = message_batch(_batch(BATCH_CANCELLED, cancelling_at=cancel, finished_at=cancel + timedelta(
        seconds=2)), RESULTS)
    assert ended["results_url"] == RESULTS and ended["processing_status"] == "ended"
    assert (ended["cancel_initiated_at"], ended["ended_at"]) == ("2026-12-06T13:01:00.250000Z",
                                                                 "2026-12-06T13:01:02.250000Z")


def test_rfc3339_is_utc_with_a_z() -> None:
    plus_two = timezone(timedelta(hours=2))
    assert rfc3339(datetime(2026, 1, 2, 5, 4, 5, tzinfo=plus_two)) == "2026-01-02T03:04:05Z"
    assert rfc3339(None) is None


def test_result_lines_of_each_kind() -> None:
    message = {"id": "msg_job_1", "type": "message"}
    assert succeeded_line("a", message) == {"custom_id": "a", "result": {"type": "succeeded",
                                                                         "message": message}}
    running = _batch(BATCH_CANCELLED)

    def result(code: str, refused: bool, batch: Batch = running) -> dict[str, Any]:
        line = unsucceeded_line(batch, "a", code, f"{code} happened", refused=refused)
        assert line["custom_id"] == "a"
        return dict(line["result"])

    def errored(error_type: str, code: str) -> dict[str, Any]:
        return {"type": "errored", "error": {"type": "error", "error": {"type": error_type,
                                                                        "message": f"{code} happened"}}}

    assert result("batch_cancelled", False) == {"type": "canceled"}
    assert result("batch_expired", False) == {"type": "expired"}
    window_ended = _batch(BATCH_EXPIRED, stop_reason=STOP_EXPIRED)
    assert result("batch_cancelled", False, window_ended) == {"type": "expired"}
    assert result("invalid_body", True) == errored("invalid_request_error", "invalid_body")
    assert result("model_not_found", True) == errored("not_found_error", "model_not_found")
    assert result("engine_error", False) == errored("api_error", "engine_error")
