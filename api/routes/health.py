"""/healthz (the process answers), /readyz (this API can take jobs: database and broker), /metrics.

Readiness says nothing of workers on purpose: with workers that scale to zero (KEDA), an API with no worker
alive must still accept jobs, which wait queued until one starts; a probe failing then would take the API
out of its Service and refuse the very submissions that wake the workers. Worker presence is reported by
/v1/queues, /v1/scaling and the metrics instead.
"""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from conveyor.api.deps import Services, ServicesDep
from conveyor.api.schemas.errors import error_responses
from conveyor.api.schemas.health import Check, Health, Readiness
from conveyor.core.store import database

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz() -> Health:
    return Health()


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
def readyz(services: ServicesDep) -> JSONResponse:
    checks = {"database": _database(services), "broker": _broker(services)}
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
