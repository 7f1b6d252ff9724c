"""The console's pages about the whole fleet, an admin's only: the workers (heartbeat age, model, queues,
the engine pace each one publishes), the tenants (their limits and what they use now), and purging a queue
(its scheduled and queued jobs cancelled, behind a confirmation page)."""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Form, Query, Request
from fastapi.responses import RedirectResponse, Response

from conveyor.api import queue_purge
from conveyor.api.console.pages import AdminDep, CsrfField, check_csrf, confirmation, page
from conveyor.api.deps import ServicesDep, SessionDep
from conveyor.api.errors import ApiError
from conveyor.core.clock import utcnow
from conveyor.core.lanes import split_lane
from conveyor.core.store import job_tallies, tenants, token_usage, workers
from conveyor.core.store.tenants import TenantLimits

router = APIRouter(prefix="/console", include_in_schema=False)
WORKERS_SHOWN = 200
TENANTS_SHOWN = 200


@router.get("/workers")
def worker_list(request: Request, viewer: AdminDep, services: ServicesDep, session: SessionDep) -> Response:
    now, dead_after_s = utcnow(), services.settings.worker_dead_after_s
    rows = []
    for worker in workers.recent(session, WORKERS_SHOWN):
        age = (now - worker.last_seen_at).total_seconds()
        state = "stopped" if worker.stopped_at else ("live" if age <= dead_after_s else "silent")
        rows.append({"worker": worker, "age_s": age, "state": state,
                     "models": sorted({split_lane(lane)[0] for lane in worker.queues}),
                     "queues": sorted({split_lane(lane)[1] for lane in worker.queues}),
                     "engine": _engine_figures(worker.rates)})
    return page(request, "workers.html", viewer, workers=rows, dead_after_s=dead_after_s)


def _engine_figures(rates: dict[str, Any] | None) -> str:
    """What a worker publishes of its engine with each heartbeat (worker/services.py _engine_pace): KV use,
    running and waiting requests, preemptions, and its pace once measured."""
    if not rates:
        return "-"
    shown = []
    if "kv_used" in rates:
        shown.append(f"KV {rates['kv_used'] * 100:.0f}%")
    shown += [f"{rates[name]:.0f} {name}" for name in ("running", "waiting", "preemptions") if name in rates]
    if rates.get("step_s"):
        shown.append(f"{rates['step_s'] * 1000:.1f} ms/step")
    return ", ".join(shown) or "-"


@router.get("/tenants")
def tenant_list(request: Request, viewer: AdminDep, services: ServicesDep, session: SessionDep) -> Response:
    now, defaults = utcnow(), TenantLimits.defaults(services.settings)
    counts = job_tallies.per_tenant(session)  # one read of the tallies for every tenant shown
    rows = [{"id": tenant.id, "limits": tenants.effective_limits(session, tenant.id, defaults),
             "counts": _counts(counts.get(tenant.id, job_tallies.QueueTally())),
             "tokens_last_minute": token_usage.tokens_used(session, tenant.id, now)}
            for tenant in tenants.list_tenants(session)[:TENANTS_SHOWN]]
    return page(request, "tenants.html", viewer, tenants=rows)


def _counts(tally: job_tallies.QueueTally) -> tuple[int, int]:
    """(queued, running) of a tenant across every queue."""
    return tally.queued, tally.running


@router.get("/purge")
def confirm_purge(request: Request, viewer: AdminDep, services: ServicesDep,
                  lane: Annotated[str, Query(max_length=200)]) -> Response:
    _check_lane(services.settings.lanes(), lane)
    detail = ("Every tenant's scheduled and queued jobs of this queue are cancelled, each with its "
              "cancelled webhook; running jobs are left alone.")
    return confirmation(request, viewer, f"Purge {lane}?", detail, "/console/purge", "Purge the queue",
                        "/console", lane=lane)


@router.post("/purge")
def purge(request: Request, viewer: AdminDep, services: ServicesDep, session: SessionDep,
          lane: Annotated[str, Form(max_length=200)], csrf: CsrfField = None) -> Response:
    check_csrf(viewer, csrf)
    _check_lane(services.settings.lanes(), lane)
    cancelled = queue_purge.purge(session, services, [lane], None)
    return RedirectResponse(f"/console?{urlencode({'purged': cancelled, 'lane': lane})}", status_code=303)


def _check_lane(lanes: list[str], lane: str) -> None:
    if lane not in lanes:
        raise ApiError(404, "unknown_queue", f"lane: no queue {lane!r}", "lane")
