"""The console's batches: the newest, a batch's progress, errors and outputs, and cancelling one (behind a
confirmation page). A tenant's key sees its own batches only; another tenant's is a 404."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response
from sqlalchemy.orm import Session

from conveyor.api.console.pages import CsrfField, ViewerDep, check_csrf, confirmation, page
from conveyor.api.console.viewer import Viewer
from conveyor.api.deps import SessionDep
from conveyor.api.errors import ApiError, can_be_stored_id
from conveyor.core.clock import utcnow
from conveyor.core.lifecycle import OPEN_BATCH_STATUSES
from conveyor.core.store import batches
from conveyor.core.store.tables import Batch
from conveyor.core.views.public import batch_public

router = APIRouter(prefix="/console", include_in_schema=False)
BATCHES_SHOWN = 50
FAILED_LINES_SHOWN = 50


@router.get("/batches")
def batch_list(request: Request, viewer: ViewerDep, session: SessionDep) -> Response:
    rows = batches.newest(session, viewer.tenant, BATCHES_SHOWN)
    return page(request, "batches.html", viewer, batches=[(row, _done(row)) for row in rows])


@router.get("/batches/{batch_id}")
def batch_page(request: Request, batch_id: str, viewer: ViewerDep, session: SessionDep) -> Response:
    row = _visible_batch(session, viewer, batch_id)
    failed = batches.failed_lines(session, row.id, FAILED_LINES_SHOWN)
    return page(request, "batch.html", viewer, batch=batch_public(row), row=row, done=_done(row),
                failed=failed, cancellable=row.status in ("validating", "in_progress"),
                open=row.status in OPEN_BATCH_STATUSES)


@router.get("/batches/{batch_id}/cancel")
def confirm_cancel(request: Request, batch_id: str, viewer: ViewerDep, session: SessionDep) -> Response:
    row = _visible_batch(session, viewer, batch_id)
    detail = (f"Tenant {row.tenant_id}. Its waiting and running lines are cancelled; finished lines keep "
              "their answers.")
    here = f"/console/batches/{row.id}"
    return confirmation(request, viewer, f"Cancel batch {row.id}?", detail, f"{here}/cancel",
                        "Cancel the batch", here)


@router.post("/batches/{batch_id}/cancel")
def cancel(request: Request, batch_id: str, viewer: ViewerDep, session: SessionDep,
           csrf: CsrfField = None) -> Response:
    check_csrf(viewer, csrf)
    row = _visible_batch(session, viewer, batch_id)
    batches.request_cancel(session, row.id, row.tenant_id, utcnow())
    return RedirectResponse(f"/console/batches/{row.id}", status_code=303)


def _done(row: Batch) -> int:
    """Lines with an outcome so far (completed, failed or cancelled)."""
    return row.completed + row.failed + row.cancelled


def _visible_batch(session: Session, viewer: Viewer, batch_id: str) -> Batch:
    row = batches.get(session, batch_id, viewer.tenant) if can_be_stored_id(batch_id) else None
    if row is None:
        raise ApiError(404, "not_found", f"id: no batch {batch_id}", "id")
    return row
