"""/v1/messages/batches: Anthropic's Message Batches on Conveyor's batches: create, retrieve, list, cancel,
delete, and the results file.

A message batch is a Conveyor batch of endpoint /v1/messages, shown by /v1/batches too under its `batch_` id
(core/views/message_batch_objects.py maps the ids). Its requests are written one line each to its input file
(purpose `batch`, as an uploaded batch file is), which the batch runner reads like any other: each line read
by the Messages rules, then judged exactly as a chat line (worker/batches/lines.py), and run as a job of the
`documents` queue; an invalid request is that line's `errored` result while the others run. Once the batch
has ended its finalizer has written the results in Anthropic's shape (worker/batches/finalize.py), succeeded
lines to its output file and the others to its error file; GET .../results streams the two.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session

from conveyor.api.anthropic_errors import AnthropicError, AnthropicRoute
from conveyor.api.auth import AnthropicTenant
from conveyor.api.batch_queues import check_batch_queue
from conveyor.api.deps import ServicesDep, SessionDep
from conveyor.api.errors import can_be_stored_id, not_found
from conveyor.api.schemas.errors import Responses, anthropic_error_responses
from conveyor.api.schemas.message_batches import (
    MAX_BODY_BYTES,
    DeletedMessageBatch,
    MessageBatchCreate,
    MessageBatchList,
    MessageBatchPublic,
    MessageBatchRequest,
)
from conveyor.core.clock import utcnow
from conveyor.core.protocol.anthropic_request import MESSAGES
from conveyor.core.settings import Settings
from conveyor.core.store import batches, blobs, files
from conveyor.core.store.batch_deletion import delete_ended_batch
from conveyor.core.store.tables import Batch, File
from conveyor.core.views.message_batch_objects import (
    batch_id_of,
    has_ended,
    message_batch,
    message_batch_id_of,
    processing_status,
)

MESSAGE_BATCHES = f"{MESSAGES}/batches"
router = APIRouter(prefix=MESSAGE_BATCHES, tags=["anthropic"], route_class=AnthropicRoute)
QUEUE = "documents"  # as every batch's by default: long inputs, deadlines in hours
WINDOW_S = 24 * 3600.0  # Anthropic's: a batch ends within 24 hours of its creation; what has not run expires
INPUT_FILENAME = "message_batch_requests.jsonl"
SPOOL_BYTES = 8 << 20  # the input is written to memory up to this, then to a temporary file
RESULTS_MEDIA_TYPE = "application/x-jsonl"
NOT_FOUND = "not_found_error: no such message batch for this tenant"


def _errors(*statuses: int) -> Responses:
    """Anthropic's error answers, a 404 meaning no such message batch."""
    declared = anthropic_error_responses(*statuses)
    if 404 in declared:
        declared[404] = {**declared[404], "description": NOT_FOUND}
    return declared


RESULTS_RESPONSES = {
    200: {"description": "one JSON object per line: each request's `custom_id` and `result`",
          "content": {RESULTS_MEDIA_TYPE: {"schema": {"type": "string"}}}},
    **_errors(400, 401, 404),
}


@router.post("", response_model=MessageBatchPublic, responses=_errors(400, 401, 413))
def create_message_batch(body: MessageBatchCreate, request: Request, session: SessionDep,
                         services: ServicesDep, tenant: AnthropicTenant) -> MessageBatchPublic:
    """Processing starts at once. The custom_ids are judged now (a duplicate refuses the batch), each
    request's params when its line is read: an invalid one is that request's `errored` result."""
    check_batch_queue(services, QUEUE)
    now = utcnow()
    source = _input_file(services.settings, tenant, body.requests)
    files.add(session, source)  # committed with the batch
    batch = batches.create(session, tenant_id=tenant, input_url=source.url, input_file_id=source.id,
                           output_url=None, queue=QUEUE, endpoint=MESSAGES, completion_window_s=WINDOW_S,
                           now=now, request_count=len(body.requests))
    return _public(batch, request)


@router.get("/{message_batch_id}", response_model=MessageBatchPublic, responses=_errors(401, 404))
def get_message_batch(message_batch_id: str, request: Request, session: SessionDep, tenant: AnthropicTenant,
                      ) -> MessageBatchPublic:
    """Poll it until `processing_status` is `ended`; then `results_url` says where its results are."""
    return _public(_message_batch_or_404(session, message_batch_id, tenant), request)


@router.get("", response_model=MessageBatchList, responses=_errors(400, 401))
def list_message_batches(
    request: Request,
    session: SessionDep,
    tenant: AnthropicTenant,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
    after_id: str | None = None,
    before_id: str | None = None,
) -> MessageBatchList:
    """Newest first. `after_id`: the page after that batch (the previous page's `last_id`); `before_id`: the
    page before it (the next page's `first_id`). An id the tenant does not have gives an empty page."""
    if after_id is not None and before_id is not None:
        raise AnthropicError(400, "before_id, after_id: send at most one of them")
    after, before = _batch_id(after_id), _batch_id(before_id)
    if (after_id, before_id) != (None, None) and (after, before) == (None, None):  # no batch has that id
        return MessageBatchList(data=[], has_more=False, first_id=None, last_id=None)
    rows = batches.page(session, tenant, limit=limit + 1, after=after, before=before, endpoint=MESSAGES)
    page = rows[-limit:] if before is not None else rows[:limit]  # the extra row is the one farthest away
    data = [_public(batch, request) for batch in page]
    return MessageBatchList(data=data, has_more=len(rows) > limit, first_id=data[0].id if data else None,
                            last_id=data[-1].id if data else None)


@router.post("/{message_batch_id}/cancel", response_model=MessageBatchPublic, responses=_errors(401, 404))
def cancel_message_batch(message_batch_id: str, request: Request, session: SessionDep,
                         tenant: AnthropicTenant) -> MessageBatchPublic:
    """The batch is `canceling` while its queued and running requests are cancelled and its results
    written, then `ended`: the requests that had not finished are `canceled`. A batch already ended (or
    whose results are being written) is answered as it is."""
    batch = _message_batch_or_404(session, message_batch_id, tenant)
    cancelled = batches.request_cancel(session, batch.id, tenant, utcnow())
    if cancelled is None:  # deleted meanwhile
        raise not_found("message batch", message_batch_id)
    return _public(cancelled, request)


@router.delete("/{message_batch_id}", response_model=DeletedMessageBatch, responses=_errors(400, 401, 404))
def delete_message_batch(message_batch_id: str, session: SessionDep, services: ServicesDep,
                         tenant: AnthropicTenant) -> DeletedMessageBatch:
    """Deletes an ended batch: its requests, its jobs and its results. One not ended is refused (400):
    cancel it and delete it once it has ended."""
    batch = _message_batch_or_404(session, message_batch_id, tenant)
    input_file_id = batch.input_file_id
    outcome = delete_ended_batch(session, services.settings, batch.id, tenant)
    if not outcome.found:
        raise not_found("message batch", message_batch_id)
    if outcome.open_status is not None:
        raise AnthropicError(400, f"message batch {message_batch_id} has not ended; cancel it and delete it "
                             "once its processing_status is ended")
    if input_file_id is not None:  # the requests' file was written by create: it goes with the batch
        _delete_file(session, services.settings, input_file_id, tenant)
    return DeletedMessageBatch(id=message_batch_id)


@router.get("/{message_batch_id}/results", response_class=StreamingResponse, responses=RESULTS_RESPONSES)
def message_batch_results(message_batch_id: str, session: SessionDep, services: ServicesDep,
                          tenant: AnthropicTenant) -> StreamingResponse:
    """The results as JSON lines, one per request (`custom_id`, `result`), in no promised order (succeeded
    first); available once the batch has ended (400 before)."""
    batch = _message_batch_or_404(session, message_batch_id, tenant)
    if not has_ended(batch):
        raise AnthropicError(400, f"message batch {message_batch_id} is {processing_status(batch)}; its "
                             "results can be read once its processing_status is ended")
    urls = [row.url for row in (_file(session, batch.output_file_id, tenant),
                                _file(session, batch.error_file_id, tenant)) if row is not None]
    return StreamingResponse(_chunks(services.settings, urls), media_type=RESULTS_MEDIA_TYPE)


def _input_file(settings: Settings, tenant: str, requests: list[MessageBatchRequest]) -> File:
    """The requests saved where uploaded batch files go, one line each in the line shape the runner reads
    (`{"custom_id", "method", "url": "/v1/messages", "body"}`); a request longer than a batch line may be
    (batch_max_line_bytes) is refused here, since the runner could not tell whose line it was."""
    file_id = files.new_file_id()
    row = File(id=file_id, tenant_id=tenant, purpose=files.BATCH, filename=INPUT_FILENAME, bytes=0,
               url=blobs.blob_url(settings, file_id), created_at=utcnow())
    with tempfile.SpooledTemporaryFile(SPOOL_BYTES) as spool:
        for index, item in enumerate(requests):
            spool.write(_line(index, item, settings.batch_max_line_bytes))
        row.bytes = spool.tell()
        spool.seek(0)
        blobs.save(settings, row.url, spool)
    return row


def _line(index: int, item: MessageBatchRequest, max_bytes: int) -> bytes:
    # ASCII escapes: any text the client sent (a lone surrogate included) stays valid JSON in UTF-8
    line = json.dumps({"custom_id": item.custom_id, "method": "POST", "url": MESSAGES, "body": item.params},
                      separators=(",", ":")).encode()
    if len(line) > max_bytes:
        raise AnthropicError(400, f"requests[{index}].params: {len(line)} bytes as a batch line; this server "
                             f"reads batch lines of at most {max_bytes} bytes")
    return line + b"\n"


def _public(batch: Batch, request: Request) -> MessageBatchPublic:
    shown_id = message_batch_id_of(batch.id)
    results_url = str(request.url_for("message_batch_results", message_batch_id=shown_id))
    return MessageBatchPublic.model_validate(message_batch(batch, results_url))


def _batch_id(message_batch_id: str | None) -> str | None:
    """The id of the batch a message batch id names; None for none, or for one no batch can have."""
    batch_id = batch_id_of(message_batch_id) if message_batch_id is not None else None
    return batch_id if batch_id is not None and can_be_stored_id(batch_id) else None


def _message_batch_or_404(session: Session, message_batch_id: str, tenant: str) -> Batch:
    """The tenant's message batch; another tenant's, a batch of another endpoint or no batch: 404."""
    batch_id = _batch_id(message_batch_id)
    batch = batches.get(session, batch_id, tenant) if batch_id is not None else None
    if batch is None or batch.endpoint != MESSAGES:
        raise not_found("message batch", message_batch_id)
    return batch


def _file(session: Session, file_id: str | None, tenant: str) -> File | None:
    return files.get(session, file_id, tenant) if file_id is not None else None


def _delete_file(session: Session, settings: Settings, file_id: str, tenant: str) -> None:
    """The row, then its bytes (after the commit: a crash in between leaves an orphan blob)."""
    deleted = files.delete_file(session, file_id, tenant)
    if deleted.url is not None:
        blobs.delete(settings, deleted.url)


def _chunks(settings: Settings, urls: list[str]) -> Iterator[bytes]:
    for url in urls:
        yield from blobs.read_chunks(settings, url)


def body_caps(settings: Settings) -> dict[tuple[str, str], int]:
    """The body-size middleware's cap on the create route, (method, path) -> bytes: Anthropic's 256 MB, less
    when uploads are capped lower (files_max_bytes: the body becomes the batch's input file), never below
    every route's (max_body_bytes)."""
    cap = max(min(MAX_BODY_BYTES, settings.files_max_bytes), settings.max_body_bytes)
    return {("POST", MESSAGE_BATCHES): cap}
