"""/v1/batches: create (OpenAI's form or Conveyor's S3 form), read, list, cancel, delete. OpenAI's Batch API
shape."""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Query
from sqlalchemy.orm import Session

from conveyor.api.auth import CurrentTenant
from conveyor.api.batch_locations import check_batch_location
from conveyor.api.batch_queues import check_batch_queue
from conveyor.api.deps import ServicesDep, SessionDep
from conveyor.api.errors import ApiError, can_be_stored_id, lookup_id, not_found
from conveyor.api.schemas.batches import BatchCreate, BatchList, BatchPublic
from conveyor.api.schemas.deleted import Deleted
from conveyor.api.schemas.errors import error_responses
from conveyor.api.schemas.jobs import webhook_json
from conveyor.api.webhook_targets import check_job_webhook
from conveyor.core.clock import utcnow
from conveyor.core.lifecycle import BATCH_CANCELLED, CANCELLING
from conveyor.core.store import batches, files
from conveyor.core.store.batch_deletion import delete_ended_batch
from conveyor.core.store.tables import Batch
from conveyor.core.views.public import batch_public

router = APIRouter(prefix="/v1/batches", tags=["batches"])


@router.post("", response_model=BatchPublic, responses=error_responses(401, 404, 413, 422))
def create_batch(body: BatchCreate, session: SessionDep, services: ServicesDep, tenant: CurrentTenant,
                 ) -> BatchPublic:
    """Accepted batches start `validating`; a worker's batch runner takes them up within a round."""
    check_batch_queue(services, body.queue)
    _check_metadata(body, services.settings.max_metadata_bytes)
    check_batch_location(body.input, services.settings.batch_s3_allowlist, "input")
    check_batch_location(body.output, services.settings.batch_s3_allowlist, "output")
    webhook = webhook_json(body.webhook)
    check_job_webhook(webhook, services.settings)  # refused now, as for a job, not only at delivery
    input_url = body.input
    if body.input_file_id is not None:
        source = files.get(session, body.input_file_id, tenant)
        if source is None or source.purpose != files.BATCH:
            message = f"input_file_id: no uploaded batch file {body.input_file_id}"
            raise ApiError(404, "not_found", message, "input_file_id")
        input_url = source.url
    assert input_url is not None
    batch = batches.create(
        session, tenant_id=tenant, input_url=input_url, input_file_id=body.input_file_id,
        output_url=body.output, queue=body.queue, endpoint=body.endpoint,
        completion_window_s=body.completion_window_s, meta=body.metadata, now=utcnow(),
        webhook=webhook, run_at=body.due_at(utcnow()),
    )
    return _public(batch)



@router.get("/{batch_id}", response_model=BatchPublic, responses=error_responses(401, 404))
def get_batch(batch_id: str, session: SessionDep, tenant: CurrentTenant) -> BatchPublic:
    """Live `request_counts` (total lines read so far, completed, failed, cancelled)."""
    return _public(_batch_or_404(session, batch_id, tenant))


@router.get("", response_model=BatchList, responses=error_responses(401, 422))
def list_batches(
    session: SessionDep,
    tenant: CurrentTenant,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: str | None = None,
) -> BatchList:
    """Newest first; pass the previous page's `last_id` as `after`."""
    if after is not None and not can_be_stored_id(after):  # an id the tenant does not have: an empty page
        return BatchList(data=[], first_id=None, last_id=None, has_more=False)
    rows = batches.page(session, tenant, limit=limit + 1, after=after)
    page, more = rows[:limit], len(rows) > limit
    data = [_public(b) for b in page]
    return BatchList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                     has_more=more)


@router.post("/{batch_id}/cancel", response_model=BatchPublic, responses=error_responses(401, 404, 409))
def cancel_batch(batch_id: str, session: SessionDep, tenant: CurrentTenant) -> BatchPublic:
    """Stops the remaining lines: queued and running ones are cancelled now, unread ones are never run; the
    batch is `cancelling` until its partial outputs are written, then `cancelled`."""
    batch = batches.request_cancel(session, lookup_id("batch", batch_id), tenant, utcnow())
    if batch is None:
        raise not_found("batch", batch_id)
    if batch.status not in (CANCELLING, BATCH_CANCELLED):
        raise ApiError(409, "not_cancellable", f"id: batch {batch_id} already {batch.status}", "id")
    return _public(batch)


@router.delete("/{batch_id}", response_model=Deleted, responses=error_responses(401, 404, 409))
def delete_batch(batch_id: str, session: SessionDep, services: ServicesDep, tenant: CurrentTenant) -> Deleted:
    """Deletes an ended batch (completed, failed, expired or cancelled): its lines, its jobs, its output
    and error files (the stored bytes too) and its webhook deliveries. Results written to an S3 `output`
    stay: they are the client's. An open batch is refused (409): cancel it and wait for it to end."""
    outcome = delete_ended_batch(session, services.settings, lookup_id("batch", batch_id), tenant)
    if not outcome.found:
        raise not_found("batch", batch_id)
    if outcome.open_status is not None:
        message = f"id: batch {batch_id} is {outcome.open_status}; cancel it and delete it once it has ended"
        raise ApiError(409, "not_deletable", message, "id")
    return Deleted(id=batch_id, object="batch")


def _check_metadata(body: BatchCreate, limit: int) -> None:
    if body.metadata is None:
        return
    size = len(json.dumps(body.metadata, separators=(",", ":")).encode())
    if size > limit:
        message = f"metadata: {size} bytes of JSON exceeds {limit}"
        raise ApiError(422, "metadata_too_large", message, "metadata")


def _public(batch: Batch) -> BatchPublic:
    return BatchPublic.model_validate(batch_public(batch))


def _batch_or_404(session: Session, batch_id: str, tenant: str) -> Batch:
    batch = batches.get(session, lookup_id("batch", batch_id), tenant)
    if batch is None:
        raise not_found("batch", batch_id)
    return batch
