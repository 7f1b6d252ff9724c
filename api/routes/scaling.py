"""/v1/scaling: the signal workers scale on, per model (KEDA's metrics-api trigger reads
`models.<id>.load`: each model's workers are a pool of their own, scaled to zero on their own).

Load is queued + running, counted in the store (the source of truth) rather than read from the broker: a
job a worker holds unacknowledged is `running` there, so scaling down never takes a busy worker for an
idle one, and a queue's load reaches 0 only when its last job has finished. Two cheap queries per poll.

It is cluster-wide, like /metrics, so it takes the same credential: the metrics token (conveyor.api.auth),
never a tenant's key.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from conveyor.api.auth import metrics_authorized
from conveyor.api.deps import ServicesDep, SessionDep
from conveyor.api.errors import ApiError
from conveyor.api.schemas.errors import error_responses
from conveyor.api.schemas.scaling import ModelScaling, QueueScaling, Scaling
from conveyor.core.clock import utcnow
from conveyor.core.store import job_tallies, workers

SCALING_PATH = "/v1/scaling"

# Declares the credential in the OpenAPI document; the check itself is metrics_authorized, as for /metrics.
metrics_bearer = HTTPBearer(auto_error=False, scheme_name="MetricsToken",
                            description="Authorization: Bearer <metrics token> (CONVEYOR_METRICS_TOKEN)")


def metrics_reader(
    request: Request, services: ServicesDep,
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(metrics_bearer)],
) -> None:
    """Refuses the request unless it may read /metrics; runs before any query."""
    if not metrics_authorized(services.settings, request.headers.get("authorization")):
        raise ApiError(401, "unauthorized", f"Authorization: {SCALING_PATH} requires the metrics token as a "
                       "Bearer token", "Authorization", {"WWW-Authenticate": "Bearer"})


router = APIRouter(tags=["scaling"])
RESPONSES = error_responses(401)
RESPONSES[401] = {**RESPONSES[401], "description": "without the metrics token, when one is required"}


@router.get(SCALING_PATH, response_model=Scaling, responses=RESPONSES, dependencies=[Depends(metrics_reader)])
def scaling(session: SessionDep, services: ServicesDep) -> Scaling:
    """Per served model and queue: queued and running jobs, their sum (`load`, what to scale on), the live
    workers consuming it and its per-worker `max_running`; and the model's load over its queues."""
    loads = job_tallies.tallies(session, may_fold=True)
    consumers = workers.live_workers_per_queue(session, now=utcnow(),
                                               dead_after_s=services.settings.worker_dead_after_s)
    models = {}
    for model in services.models:
        queues = {}
        for name, limits in model.settings.queues.items():
            lane = model.lane(name)
            counted = loads.get(lane, job_tallies.QueueTally())
            queues[name] = QueueScaling(queued=counted.queued, running=counted.running, load=counted.load,
                                        workers=consumers.get(lane, 0), max_running=limits.max_running)
        models[model.id] = ModelScaling(load=sum(q.load for q in queues.values()), queues=queues)
    return Scaling(models=models, queues=_per_queue(models))


def _per_queue(models: dict[str, ModelScaling]) -> dict[str, QueueScaling]:
    """Each queue name's figures summed over the models; max_running is the first (default) model's."""
    summed: dict[str, QueueScaling] = {}
    for model in models.values():
        for name, q in model.queues.items():
            seen = summed.get(name)
            summed[name] = q.model_copy() if seen is None else seen.model_copy(update={
                "queued": seen.queued + q.queued, "running": seen.running + q.running,
                "load": seen.load + q.load, "workers": seen.workers + q.workers})
    return summed
