"""/healthz (the process answers), /readyz (database, broker, a live worker), /metrics (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from api.deps import Services, ServicesDep
from api.schemas.errors import error_responses
from api.schemas.health import Check, Health, Readiness
from core.clock import utcnow
from core.store import database, workers

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz() -> Health:
    return Health()


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
def readyz(services: ServicesDep) -> JSONResponse:
    checks = {"database": _database(services), "broker": _broker(services), "worker": _worker(services)}
    body = Readiness(ready=all(c.ok for c in checks.values()), checks=checks)
    return JSONResponse(body.model_dump(), status_code=200 if body.ready else 503)


@router.get("/metrics", response_class=Response, responses={
    200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}, "description": "Prometheus text"},
    **error_responses(401),  # without the metrics token, when one is required
})
def metrics(services: ServicesDep) -> Response:
    return Response(services.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _database(services: Services) -> Check:
    try:
        with services.session_factory() as session:
            database.ping(session)
    except Exception as exc:
        return Check(ok=False, detail=f"unreachable: {type(exc).__name__}")
    return Check(ok=True, detail="reachable")


def _broker(services: Services) -> Check:
    try:
        ok = services.publisher.ping()
    except Exception as exc:
        return Check(ok=False, detail=f"unreachable: {type(exc).__name__}")
    return Check(ok=ok, detail="reachable" if ok else "unreachable")


def _worker(services: Services) -> Check:
    dead_after = services.settings.worker_dead_after_s
    try:
        with services.session_factory() as session:
            n = len(workers.live_workers(session, now=utcnow(), dead_after_s=dead_after))
    except Exception as exc:
        return Check(ok=False, detail=f"unknown: {type(exc).__name__}")
    if n == 0:
        return Check(ok=False, detail=f"no worker seen in the last {dead_after:g} s")
    return Check(ok=True, detail=f"{n} live worker(s)")
