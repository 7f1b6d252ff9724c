"""The console's overview of every queue, its jobs, one job, and the actions on a job (cancel, retry), each
behind a confirmation page and a CSRF-checked POST."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Annotated
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Query, Request
from fastapi.responses import RedirectResponse, Response
from sqlalchemy.orm import Session

from conveyor.api import cursor, job_actions
from conveyor.api.console.pages import CsrfField, ViewerDep, check_csrf, confirmation, page
from conveyor.api.console.viewer import Viewer
from conveyor.api.deps import ServicesDep, SessionDep
from conveyor.api.errors import ApiError, can_be_stored_id
from conveyor.core.clock import utcnow
from conveyor.core.lanes import split_lane
from conveyor.core.lifecycle import JOB_STATUSES, RETRYABLE_STATUSES, WAITING_STATUSES
from conveyor.core.store import job_tallies, jobs, webhooks, workers
from conveyor.core.store.tables import Delivery, Job
from conveyor.core.views.public import JobPublic

router = APIRouter(prefix="/console", include_in_schema=False)
PAGE = 50  # jobs per page
GOODPUT_WINDOW = timedelta(hours=1)  # the overview's on-time share: jobs with a deadline that ended in it
MAX_HOURS = 24 * 366  # the jobs listing's "created in the last hours" filter
SPARK_MINUTES = 30  # the overview's throughput line: jobs succeeded per minute, this many minutes back


@router.get("")
def overview(request: Request, viewer: ViewerDep, services: ServicesDep, session: SessionDep,
             purged: Annotated[int | None, Query(ge=0)] = None,
             purged_lane: Annotated[str | None, Query(alias="lane", max_length=200)] = None) -> Response:
    now = utcnow()
    counts = job_tallies.queue_counts(session, now, viewer.tenant, may_fold=True)
    deadlines = jobs.deadline_counts(session, now - GOODPUT_WINDOW, viewer.tenant)
    dead_after_s = services.settings.worker_dead_after_s
    live = workers.live_workers_per_queue(session, now=now, dead_after_s=dead_after_s)
    rows = []
    for lane in services.settings.lanes():
        c = counts.get(lane, job_tallies.QueueCounts(0, 0, None))
        model, queue = split_lane(lane)
        oldest_s = (now - c.oldest_queued_at).total_seconds() if c.oldest_queued_at else None
        per_minute = jobs.succeeded_per_minute(session, lane, now, SPARK_MINUTES, viewer.tenant)
        rows.append({"model": model, "queue": queue, "lane": lane, "queued": c.queued, "running": c.running,
                     "scheduled": c.scheduled, "workers": live.get(lane, 0), "oldest_s": oldest_s,
                     "on_time": _on_time_share(deadlines.get(lane, {})), "per_minute": per_minute})
    return page(request, "overview.html", viewer, queues=rows, failures=_failures(session, viewer, now),
                purged=purged, purged_lane=purged_lane)


def _on_time_share(by_tier: dict[str, dict[str, int]]) -> float | None:
    """Of the jobs with a deadline that ended in the last hour, the share on time; None: there were none."""
    outcomes = [n for tier in by_tier.values() for n in tier.items()]
    total = sum(n for _, n in outcomes)
    return sum(n for kind, n in outcomes if kind == "on_time") / total if total else None


def _failures(session: Session, viewer: Viewer, now: datetime) -> list[tuple[str, str, int]]:
    """(lane, code, count) of the viewer's jobs that failed or expired in the last hour."""
    return jobs.failures_since(session, now - GOODPUT_WINDOW, viewer.tenant)


@router.get("/jobs")
def job_list(request: Request, viewer: ViewerDep, services: ServicesDep, session: SessionDep,
             status: Annotated[str | None, Query(max_length=16)] = None,
             tenant: Annotated[str | None, Query(max_length=64)] = None,
             lane: Annotated[str | None, Query(max_length=200)] = None,
             batch: Annotated[str | None, Query(max_length=40)] = None,
             find: Annotated[str | None, Query(max_length=64)] = None,
             model: Annotated[str | None, Query(max_length=128)] = None,
             hours: Annotated[str | None, Query(max_length=8, description="the last HOURS")] = None,
             meta: Annotated[str | None, Query(max_length=300, description="KEY=VALUE")] = None,
             cursor_: Annotated[str | None, Query(alias="cursor", max_length=200)] = None) -> Response:
    shown_tenant = viewer.tenant if viewer.tenant is not None else (tenant or None)
    status = status or None
    if status is not None and status not in JOB_STATUSES:
        raise ApiError(422, "invalid_request", f"status: one of {', '.join(JOB_STATUSES)}", "status")
    if find:  # a job id: straight to its page (a 404 there when the viewer may not see it)
        return RedirectResponse(f"/console/jobs/{quote(find.strip(), safe='')}", status_code=303)
    lanes = _lanes(services.settings.lanes(), lane or None, model or None)
    since = utcnow() - timedelta(hours=_hours(hours)) if hours else None
    rows = jobs.page(session, shown_tenant, limit=PAGE + 1, status=status, before=_before(cursor_),
                     lanes=lanes, batch_id=batch or None, since=since, metadata=_metadata(meta))
    shown, more = rows[:PAGE], len(rows) > PAGE
    filters = {"status": status, "tenant": shown_tenant, "lane": lane, "batch": batch, "model": model,
               "hours": hours, "meta": meta}
    older = _listing_url({"cursor": cursor.encode(shown[-1]), **filters}) if more else None
    return page(request, "jobs.html", viewer, jobs=[JobPublic.from_row(j) for j in shown],
                tenants={j.id: j.tenant_id for j in shown}, statuses=JOB_STATUSES, older_url=older, **filters)


def _listing_url(query: dict[str, str | None]) -> str:
    """The listing with these filters, each value encoded: a tenant named `a&tenant=b` stays one value."""
    return f"/console/jobs?{urlencode({name: value for name, value in query.items() if value})}"


def _lanes(known: list[str], lane: str | None, model: str | None) -> list[str] | None:
    """The lanes a listing covers: one, a model's, or (None) all."""
    if lane is not None and lane not in known:
        raise ApiError(422, "unknown_queue", f"lane: no queue {lane!r}", "lane")
    if lane is not None:
        return [lane]
    if model is None:
        return None
    of_model = [name for name in known if split_lane(name)[0] == model]
    if not of_model:
        raise ApiError(422, "unknown_model", f"model: no served model {model!r}", "model")
    return of_model


def _hours(text: str) -> float:
    """The form's `hours` (its "any time" sends it empty, handled by the caller)."""
    try:
        hours = float(text)
    except ValueError:
        hours = -1.0
    if not 0 < hours <= MAX_HOURS:
        raise ApiError(422, "invalid_request", f"hours: a number of hours, above 0 and at most {MAX_HOURS}",
                       "hours")
    return hours


def _metadata(meta: str | None) -> tuple[str, str] | None:
    if not meta:
        return None
    key, equals, value = meta.partition("=")
    if not equals or not key.strip():
        raise ApiError(422, "invalid_request", "meta: KEY=VALUE, e.g. doc=42", "meta")
    return key.strip(), value.strip()


def _before(cursor_: str | None) -> tuple[datetime, str] | None:
    if not cursor_:
        return None
    try:
        before = cursor.decode(cursor_)
    except ValueError as exc:
        raise ApiError(422, "invalid_request", str(exc), "cursor") from exc
    if not can_be_stored_id(before[1]):
        raise ApiError(422, "invalid_request", "cursor: not a cursor this console made", "cursor")
    return before


@router.get("/jobs/{job_id}")
def job_page(request: Request, job_id: str, viewer: ViewerDep, session: SessionDep) -> Response:
    job = _visible_job(session, viewer, job_id)
    deliveries = [{"id": d.id, "event_type": d.event_type, "status": d.status, "attempts": d.attempts,
                   "target": _without_query(d.url), "created_at": d.created_at}
                  for d in webhooks.for_subject(session, job.tenant_id, "job", job.id)]
    return page(request, "job.html", viewer, job=JobPublic.from_row(job), row=job, deliveries=deliveries,
                cancellable=job.status in (*WAITING_STATUSES, "running"),
                retryable=job.status in RETRYABLE_STATUSES)


ACTIONS = {"cancel": "Cancel", "retry": "Retry"}


@router.get("/jobs/{job_id}/{action}")
def confirm_action(request: Request, job_id: str, action: str, viewer: ViewerDep, session: SessionDep,
                   ) -> Response:
    job = _visible_job(session, viewer, job_id)
    if action not in ACTIONS:
        raise ApiError(404, "not_found", f"no console action {action!r}", None)
    verb = ACTIONS[action]
    return confirmation(request, viewer, f"{verb} job {job.id}?", f"Tenant {job.tenant_id}.",
                        f"/console/jobs/{job.id}/{action}", verb, f"/console/jobs/{job.id}")


@router.post("/jobs/{job_id}/{action}")
def do_action(request: Request, job_id: str, action: str, viewer: ViewerDep, services: ServicesDep,
              session: SessionDep, csrf: CsrfField = None) -> Response:
    check_csrf(viewer, csrf)
    job = _visible_job(session, viewer, job_id)
    if action == "cancel":
        job_actions.cancel(session, services, job.tenant_id, job.id)
    elif action == "retry":
        job_actions.retry(session, services, job.tenant_id, job.id, utcnow())
    else:
        raise ApiError(404, "not_found", f"no console action {action!r}", None)
    return RedirectResponse(f"/console/jobs/{job.id}", status_code=303)


@router.get("/jobs/{job_id}/deliveries/{delivery_id}/resend")
def confirm_resend(request: Request, job_id: str, delivery_id: str, viewer: ViewerDep, session: SessionDep,
                   ) -> Response:
    job = _visible_job(session, viewer, job_id)
    delivery = _delivery_of(session, job, delivery_id)
    detail = f"To {_without_query(delivery.url)}, with the same webhook-id, on a fresh retry schedule."
    return confirmation(request, viewer, f"Send {delivery.event_type} again?", detail,
                        f"/console/jobs/{job.id}/deliveries/{delivery.id}/resend", "Resend",
                        f"/console/jobs/{job.id}")


@router.post("/jobs/{job_id}/deliveries/{delivery_id}/resend")
def resend(request: Request, job_id: str, delivery_id: str, viewer: ViewerDep, session: SessionDep,
           csrf: CsrfField = None) -> Response:
    check_csrf(viewer, csrf)
    job = _visible_job(session, viewer, job_id)
    webhooks.resend(session, job.tenant_id, _delivery_of(session, job, delivery_id).id, utcnow())
    return RedirectResponse(f"/console/jobs/{job.id}", status_code=303)


def _delivery_of(session: Session, job: Job, delivery_id: str) -> Delivery:
    """One of the job's own deliveries; another's (or none) is a 404."""
    delivery = webhooks.delivery(session, job.tenant_id, delivery_id)
    if delivery is None or delivery.subject_type != "job" or delivery.subject_id != job.id:
        raise ApiError(404, "not_found", f"id: job {job.id} has no delivery {delivery_id}", "id")
    return delivery


def _visible_job(session: Session, viewer: Viewer, job_id: str) -> Job:
    """The job if the viewer may see it; else the same 404 as for a job that does not exist."""
    job = jobs.get(session, job_id, viewer.tenant) if can_be_stored_id(job_id) else None
    if job is None:
        raise ApiError(404, "not_found", f"id: no job {job_id}", "id")
    return job


def _without_query(url: str) -> str:
    """A webhook target as shown: its query string may hold a token, so it is left out."""
    return url.split("?", 1)[0]
