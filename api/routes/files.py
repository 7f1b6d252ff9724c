"""/v1/files: upload (multipart, purpose `batch`), read, download, delete. OpenAI's Files API shape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from conveyor.api.auth import CurrentTenant
from conveyor.api.deps import Services, ServicesDep, SessionDep
from conveyor.api.errors import ApiError, can_be_stored_id, lookup_id, not_found
from conveyor.api.schemas.deleted import Deleted
from conveyor.api.schemas.errors import error_responses
from conveyor.api.schemas.files import UPLOAD_BODY, FileList, FilePublic
from conveyor.core.clock import utcnow
from conveyor.core.store import blobs, files
from conveyor.core.store.tables import File

router = APIRouter(prefix="/v1/files", tags=["files"])
MAX_FILENAME_CHARS = 255
DEFAULT_FILENAME = "upload.jsonl"


# The form is parsed by hand (streamed, with part limits), so its schema is declared here.
@router.post("", response_model=FilePublic, responses=error_responses(401, 413, 422),
             openapi_extra={"requestBody": UPLOAD_BODY})
async def upload_file(request: Request, services: ServicesDep, tenant: CurrentTenant) -> FilePublic:
    """multipart/form-data with `file` and `purpose` ("batch"). The bytes stream to the file store (a local
    folder when embedded, S3 otherwise); uploads are capped at files_max_bytes."""
    form = await request.form(max_files=1, max_fields=8)
    try:
        upload, purpose = form.get("file"), form.get("purpose")
        if purpose != files.BATCH:
            raise ApiError(422, "invalid_request", f"purpose: must be 'batch', got {purpose!r}", "purpose")
        if not isinstance(upload, UploadFile):
            raise ApiError(422, "invalid_request", "file: a file part is required", "file")
        row = File(id=files.new_file_id(), tenant_id=tenant, purpose=files.BATCH,
                         filename=_filename(upload.filename), bytes=0, url="", created_at=utcnow())
        row.url = blobs.blob_url(services.settings, row.id)
        row.bytes = await run_in_threadpool(_save, services, upload, row.url)
        await run_in_threadpool(_insert, services, row)
    finally:
        await form.close()
    return FilePublic.from_row(row)


@router.get("", response_model=FileList, responses=error_responses(401, 422))
def list_files(
    session: SessionDep,
    tenant: CurrentTenant,
    purpose: Literal["batch", "batch_output"] | None = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 100,
    after: str | None = None,
) -> FileList:
    """Newest first; pass the previous page's `last_id` as `after`."""
    if after is not None and not can_be_stored_id(after):  # an id the tenant does not have: an empty page
        return FileList(data=[], first_id=None, last_id=None, has_more=False)
    rows = files.page(session, tenant, limit=limit + 1, after=after, purpose=purpose)
    data = [FilePublic.from_row(row) for row in rows[:limit]]
    return FileList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                    has_more=len(rows) > limit)


@router.get("/{file_id}", response_model=FilePublic, responses=error_responses(401, 404))
def get_file(file_id: str, session: SessionDep, tenant: CurrentTenant) -> FilePublic:
    return FilePublic.from_row(_file_or_404(session, file_id, tenant))


@router.get("/{file_id}/content", response_class=StreamingResponse, responses={
    200: {"description": "the file's bytes",
          "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
    **error_responses(401, 404),
})
def file_content(file_id: str, session: SessionDep, services: ServicesDep, tenant: CurrentTenant,
                 ) -> StreamingResponse:
    row = _file_or_404(session, file_id, tenant)
    chunks: Iterator[bytes] = blobs.read_chunks(services.settings, row.url)
    headers = {"Content-Length": str(row.bytes)}
    return StreamingResponse(chunks, media_type="application/octet-stream", headers=headers)


@router.delete("/{file_id}", response_model=Deleted, responses=error_responses(401, 404, 409))
def delete_file(file_id: str, session: SessionDep, services: ServicesDep, tenant: CurrentTenant) -> Deleted:
    """Deletes the file and its stored bytes (OpenAI's `client.files.delete`). A file an open batch still
    reads as its input is refused (409) until the batch has ended."""
    outcome = files.delete_file(session, lookup_id("file", file_id), tenant)
    if not outcome.found:
        raise not_found("file", file_id)
    if outcome.open_batch_id is not None:
        message = f"id: file {file_id} is the input of batch {outcome.open_batch_id}, which has not ended"
        raise ApiError(409, "not_deletable", message, "id")
    assert outcome.url is not None
    blobs.delete(services.settings, outcome.url)  # after the commit: a failure here leaves an orphan blob
    return Deleted(id=file_id, object="file")


def _filename(name: str | None) -> str:
    """The client's file name as text we can store and show: NUL dropped, anything not encodable (lone
    surrogates) replaced, at most MAX_FILENAME_CHARS (the end, which holds the extension)."""
    text = (name or "").replace("\x00", "").encode("utf-8", errors="replace").decode("utf-8")
    return text[-MAX_FILENAME_CHARS:] or DEFAULT_FILENAME


def _save(services: Services, upload: UploadFile, url: str) -> int:
    upload.file.seek(0, 2)
    size = upload.file.tell()  # the form parser spooled the part to a temporary file
    upload.file.seek(0)
    blobs.save(services.settings, url, upload.file)
    return size


def _insert(services: Services, row: File) -> None:
    with services.session_factory() as session:
        files.add(session, row)
        session.commit()


def _file_or_404(session: Session, file_id: str, tenant: str) -> File:
    row = files.get(session, lookup_id("file", file_id), tenant)
    if row is None:
        raise not_found("file", file_id)
    return row
