"""Anthropic's Message Batches objects, rendered from Conveyor's batches: the `message_batch` object and the
lines of its results file.

A message batch is a Conveyor batch of endpoint /v1/messages; its id is the batch's under Anthropic's prefix
(batch_<hex> <-> msgbatch_<hex>), so the same batch is also shown by /v1/batches.

- processing_status: `in_progress` while the batch is open (validating, in_progress, finalizing), `canceling`
  while a cancel is carried out, `ended` once it has closed (completed, failed, expired, cancelled).
- request_counts: as Anthropic counts them, every request is `processing` until the whole batch has ended,
  then `succeeded`, `errored`, `canceled` or `expired`, summing to the requests it was created with. Requests
  the batch never finished are `canceled` when a cancel cut them short, `expired` when the end of its 24-hour
  window did (the runner stops it then: stop_reason `expired`).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from conveyor.core.lifecycle import (
    CANCELLING,
    LINE_CANCELLED_CODE,
    LINE_EXPIRED_CODE,
    OPEN_BATCH_STATUSES,
    STOP_EXPIRED,
)
from conveyor.core.store.tables import Batch
from conveyor.core.views.anthropic_objects import error_body

MESSAGE_BATCH_PREFIX = "msgbatch_"
BATCH_PREFIX = "batch_"  # core/store/batches.new_batch_id
IN_PROGRESS, CANCELING, ENDED = "in_progress", "canceling", "ended"
# The error type of a request the rules refused, by its line code (worker/batches/lines.py): the type the
# synchronous POST /v1/messages answers the same refusal with.
_REFUSAL_TYPES = {"model_not_found": "not_found_error", "priority_not_permitted": "permission_error"}


def message_batch_id_of(batch_id: str) -> str:
    assert batch_id.startswith(BATCH_PREFIX), batch_id
    return MESSAGE_BATCH_PREFIX + batch_id.removeprefix(BATCH_PREFIX)


def batch_id_of(message_batch_id: str) -> str | None:
    """The id of the batch a message batch id names; None when it is not a message batch id."""
    if not message_batch_id.startswith(MESSAGE_BATCH_PREFIX):
        return None
    return BATCH_PREFIX + message_batch_id.removeprefix(MESSAGE_BATCH_PREFIX)


def processing_status(batch: Batch) -> str:
    if batch.status == CANCELLING:
        return CANCELING
    return IN_PROGRESS if batch.status in OPEN_BATCH_STATUSES else ENDED


def has_ended(batch: Batch) -> bool:
    return processing_status(batch) == ENDED


def request_counts(batch: Batch) -> dict[str, int]:
    requests = batch.request_count if batch.request_count is not None else batch.total
    if not has_ended(batch):
        return {"processing": requests, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
    # Every line is counted once it has ended (the finalizer counts the unread ones as cancelled); a batch
    # given up on (`failed`) may close with lines never read, and those are errored too.
    cut_short = batch.cancelled
    window_ended = _window_ended(batch)
    return {"processing": 0, "succeeded": batch.completed,
            "errored": max(requests - batch.completed - cut_short, 0),
            "canceled": 0 if window_ended else cut_short, "expired": cut_short if window_ended else 0}


def message_batch(batch: Batch, results_url: str) -> dict[str, Any]:
    """The `message_batch` object; `results_url`, where its results are read, is shown once it has ended."""
    ended = has_ended(batch)
    assert batch.expires_at is not None, "a batch's window is set when it is created"
    return {
        "id": message_batch_id_of(batch.id), "type": "message_batch",
        "processing_status": processing_status(batch), "request_counts": request_counts(batch),
        "ended_at": rfc3339(batch.finished_at) if ended else None,
        "created_at": rfc3339(batch.created_at), "expires_at": rfc3339(batch.expires_at),
        "cancel_initiated_at": rfc3339(batch.cancelling_at), "archived_at": None,
        "results_url": results_url if ended else None,
    }


def rfc3339(when: datetime | None) -> str | None:
    """As Anthropic writes times: RFC 3339 in UTC with a `Z`, e.g. 2024-09-24T18:37:24.100435Z."""
    return None if when is None else when.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


# --- the results file: one line per request --------------------------------------------------------------


def succeeded_line(custom_id: str, message: dict[str, Any]) -> dict[str, Any]:
    """A request that ran: its `message` object (core/views/anthropic_objects.py message_object)."""
    return {"custom_id": custom_id, "result": {"type": "succeeded", "message": message}}


def unsucceeded_line(batch: Batch, custom_id: str | None, code: str, message: str, *, refused: bool,
                     ) -> dict[str, Any]:
    """A request that did not run to its message, from its line's error (code and message): cut short
    (`canceled` or `expired`), refused by the request rules (`refused`: errored as the synchronous route
    would answer it, mostly invalid_request_error), or failed while it ran (errored, api_error)."""
    return {"custom_id": custom_id, "result": _unsucceeded_result(batch, code, message, refused)}


def _unsucceeded_result(batch: Batch, code: str, message: str, refused: bool) -> dict[str, Any]:
    if code == LINE_EXPIRED_CODE or (code == LINE_CANCELLED_CODE and _window_ended(batch)):
        return {"type": "expired"}
    if code == LINE_CANCELLED_CODE:
        return {"type": "canceled"}
    error_type = _REFUSAL_TYPES.get(code, "invalid_request_error") if refused else "api_error"
    return {"type": "errored", "error": error_body(error_type, message)}


def _window_ended(batch: Batch) -> bool:
    """The batch was stopped by the end of its window: whatever it never finished expired."""
    return batch.stop_reason == STOP_EXPIRED
