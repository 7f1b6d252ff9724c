"""Accepting a job of either kind: the request rules (core/protocol/request_limits.py and
core/protocol/embedding_rules.py, the same for every door, applied by api/job_requests.py) answered as 4xx,
admission, idempotency, insert; the dispatch relay publishes it (reconciler scheme,
core/seams/dispatch.py)."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from conveyor.api import admission
from conveyor.api.deps import Services
from conveyor.api.errors import ApiError, raise_problem
from conveyor.api.job_requests import JobRequest, job_request
from conveyor.api.schemas.jobs import AnyJobCreate, JobCreate
from conveyor.api.served_models import ServedModel
from conveyor.api.webhook_targets import check_job_webhook
from conveyor.core.lanes import describe_lane, split_lane
from conveyor.core.lifecycle import QUEUED
from conveyor.core.model_adapters import job_model_id, with_lora
from conveyor.core.protocol.request_limits import idempotency_key_problem, metadata_problem
from conveyor.core.protocol.service_tiers import PriorityNotPermitted, takes_default_deadline
from conveyor.core.settings import QueueSettings, UnknownModelError
from conveyor.core.store import finish_times, jobs
from conveyor.core.store.tables import Job
from conveyor.core.store.tenants import TenantLimits


def submit(
    session: Session, services: Services, tenant_id: str, body: AnyJobCreate, idempotency_key: str | None,
    now: datetime, *, responses_request: dict[str, Any] | None = None,
) -> tuple[Job, bool]:
    """Returns (job, created); created is False when an Idempotency-Key replays an earlier submission.
    `responses_request`: what a POST /v1/responses said beyond the job's fields, kept with the job."""
    served = _served_model(services, body, tenant_id)
    queue = _queue(services, served, body.queue)
    try:
        request = job_request(body, served, queue)
        job, created = _submit(session, services, served, tenant_id, body, request, queue, idempotency_key,
                               now, responses_request)
    except ApiError as exc:
        label = body.queue if body.queue in served.settings.queues else "unknown"
        services.metrics.jobs_rejected.labels(served.id, label, exc.code).inc()
        raise
    if created:
        services.metrics.jobs_submitted.labels(served.id, body.queue).inc()
        services.admission.admitted(job.queue, tenant_id)
        services.queue_rates.admitted(job.queue, request.choices * request.max_tokens)
        if job.status == QUEUED:  # a scheduled one is published when due (worker/promoter.py)
            services.dispatcher.dispatch(job.id, job.queue)
    return job, created


def _submit(
    session: Session, services: Services, served: ServedModel, tenant_id: str, body: AnyJobCreate,
    request: JobRequest, queue: QueueSettings, idempotency_key: str | None, now: datetime,
    responses_request: dict[str, Any] | None,
) -> tuple[Job, bool]:
    lane = served.lane(body.queue)
    request.check()
    raise_problem(metadata_problem(body.metadata, services.settings.max_metadata_bytes))
    check_job_webhook(body.webhook_json(), services.settings)
    request_hash = jobs.request_hash(_hashed(body))
    if idempotency_key is not None:
        raise_problem(idempotency_key_problem(idempotency_key))
        earlier = jobs.by_idempotency_key(session, tenant_id, idempotency_key)
        if earlier is not None:
            return _replay(earlier, request_hash), False
    _admit(session, services, lane, queue)  # before tokenizing: an overloaded queue costs no CPU
    quota = services.auth_cache.limits(session, tenant_id)
    _refuse(admission.queued_refusal(session, services.admission, quota, tenant_id, lane,
                                     services.settings.retry_after_s))
    prompt_tokens = request.count_prompt_tokens()
    wanted = prompt_tokens + request.choices * request.max_tokens  # each choice may write max_tokens
    _refuse(admission.tokens_refusal(session, quota, tenant_id, wanted, now, request.reserved))
    deadline_s = _deadline_s(body, queue)
    run_at = body.due_at(now)
    forecast = finish_times.Forecast(None, None)  # a scheduled job's backlog then is unknown now
    if run_at is None or run_at <= now:
        forecast = _forecast(session, services, lane, body, request, deadline_s, prompt_tokens, now)
    else:
        limit = quota.max_queued if quota.max_queued is not None else queue.max_queued
        _refuse(admission.scheduled_refusal(session, limit, tenant_id, lane, services.settings.retry_after_s))
    fields = request.job_fields()
    fields["params"] = with_lora(fields["params"], served.lora)  # its adapter, run by the base's workers
    new = jobs.NewJob(
        tenant_id=tenant_id, queue=lane, meta=body.metadata, webhook=body.webhook_json(),
        idempotency_key=idempotency_key, request_hash=request_hash, prompt_tokens=prompt_tokens,
        ttl_s=body.ttl if body.ttl is not None else queue.default_ttl_s, timeout_s=body.timeout,
        priority=_priority(body, quota), deadline_s=deadline_s, predicted_finish_at=forecast.finish_at,
        start_by=forecast.start_by, service_tier=body.service_tier, run_at=run_at,
        max_retries=body.max_retries if body.max_retries is not None else queue.max_retries,
        responses_request=responses_request, **fields,
    )
    try:
        return jobs.add(session, new, now), True
    except IntegrityError:  # a concurrent submission with the same Idempotency-Key won the insert
        session.rollback()
        assert idempotency_key is not None
        earlier = jobs.by_idempotency_key(session, tenant_id, idempotency_key)
        assert earlier is not None, "an IntegrityError on insert can only be the idempotency key"
        return _replay(earlier, request_hash), False


def admit_retry(session: Session, services: Services, tenant_id: str, job: Job) -> None:
    """A job about to run again is admitted as a new submission of it would be: its model served to its
    tenant (an adapter loaded for some tenants only is not served to the others) in the job's lane, its
    queue's room and its tenant's queued limit (a 429 with Retry-After, or a 409 when its model or queue is
    no longer served to the tenant)."""
    model_id = job_model_id(job.queue, job.params)
    name = split_lane(job.queue)[1]
    try:
        served = services.models.get(model_id, tenant_id)
    except UnknownModelError:
        raise ApiError(409, "not_retryable", f"id: the job's model {model_id!r} is no longer served",
                       "id") from None
    queue = served.settings.queue(name)
    if queue is None or served.lane(name) != job.queue:  # an adapter reloaded onto another base model
        raise ApiError(409, "not_retryable", f"id: the job's queue {describe_lane(job.queue)} is no longer "
                       "served", "id")
    _admit(session, services, job.queue, queue)
    quota = services.auth_cache.limits(session, tenant_id)
    _refuse(admission.queued_refusal(session, services.admission, quota, tenant_id, job.queue,
                                     services.settings.retry_after_s))


LATER_FIELDS = ("run_at", "delay_s", "max_retries")  # hashed only when set (issue 36 added them)


def _hashed(body: AnyJobCreate) -> dict[str, Any]:
    """The body an Idempotency-Key replay must match. A generation job's is hashed without `model` when it
    names none and without `kind`, and any job's without the LATER_FIELDS left unset: the body as it was
    before they could be named, so that a retry with the same key across an upgrade still matches."""
    unnamed = {"model"} if body.model is None else set()
    unnamed |= {name for name in LATER_FIELDS if getattr(body, name) is None}
    if isinstance(body, JobCreate):
        unnamed.add("kind")
    return body.model_dump(mode="json", exclude=unnamed or None)


def _priority(body: AnyJobCreate, quota: TenantLimits) -> int:
    """The job's priority within its tenant's range; asking outside it is a 403 naming the field."""
    try:
        return quota.priorities.job_priority(body.service_tier, body.priority)
    except PriorityNotPermitted as exc:
        raise ApiError(403, "priority_not_permitted", str(exc), exc.field) from None


def _forecast(session: Session, services: Services, lane: str, body: AnyJobCreate, request: JobRequest,
              deadline_s: float | None, prompt_tokens: int, now: datetime) -> finish_times.Forecast:
    """A job with a deadline: its latest start and when it would finish (finish_times.forecast). With
    on_deadline_miss reject, a prediction past the deadline is a 429 deadline_unattainable, to retry once the
    backlog shrank."""
    if deadline_s is None:
        return finish_times.Forecast(None, None)
    forecast = finish_times.forecast(
        session, lane, now, deadline_s=deadline_s, prompt_tokens=prompt_tokens,
        max_tokens=request.max_tokens, choices=request.choices,
        dead_after_s=services.settings.worker_dead_after_s, rates=services.queue_rates)
    if forecast.finish_at is not None:
        _refuse_late(body, deadline_s, (forecast.finish_at - now).total_seconds())
    return forecast


def _refuse_late(body: AnyJobCreate, deadline_s: float, predicted_s: float) -> None:
    late_s = predicted_s - deadline_s
    if body.on_deadline_miss == "reject" and late_s > 0:
        message = (f"deadline_s: the job would finish in about {deadline_s + late_s:.0f} s, past its "
                   f"deadline of {deadline_s:g} s (its queue's recent rate and the work ahead of it)")
        headers = {"Retry-After": str(math.ceil(late_s))}
        raise ApiError(429, "deadline_unattainable", message, "deadline_s", headers)


def _deadline_s(body: AnyJobCreate, queue: QueueSettings) -> float | None:
    """The job's own deadline, else its queue's default (which flex work does not take)."""
    if body.deadline_s is not None or not takes_default_deadline(body.service_tier):
        return body.deadline_s
    return queue.default_deadline_s


def _served_model(services: Services, body: AnyJobCreate, tenant_id: str) -> ServedModel:
    try:
        return services.models.get(body.model, tenant_id)
    except UnknownModelError as exc:
        services.metrics.jobs_rejected.labels("unknown", "unknown", "model_not_found").inc()
        raise ApiError(404, "model_not_found", str(exc), "model") from None


def _queue(services: Services, served: ServedModel, name: str) -> QueueSettings:
    queue = served.settings.queue(name)
    if queue is None:
        known = ", ".join(sorted(served.settings.queues))
        services.metrics.jobs_rejected.labels(served.id, "unknown", "unknown_queue").inc()
        raise ApiError(422, "unknown_queue", f"queue: unknown queue {name!r}; known queues: {known}", "queue")
    return queue


def _replay(earlier: Job, request_hash: str) -> Job:
    if earlier.request_hash != request_hash:
        message = f"Idempotency-Key: already used for job {earlier.id} with a different request body"
        raise ApiError(409, "idempotency_conflict", message, "Idempotency-Key")
    return earlier


def _admit(session: Session, services: Services, lane: str, queue: QueueSettings) -> None:
    # NOTE: a soft cap, estimated per process (api/admission.py; "Admission control" in
    # docs/getting-started/postgres-redis.md).
    if not services.admission.has_room(session, lane, queue.max_queued):
        retry_after = str(services.settings.retry_after_s)
        message = (f"queue: the {describe_lane(lane)} is full ({queue.max_queued} queued); retry after "
                   f"{retry_after} s")
        raise ApiError(429, "queue_full", message, "queue", {"Retry-After": retry_after})


def _refuse(refusal: admission.Refusal | None) -> None:
    """A tenant quota's refusal as the HTTP error: 429 with Retry-After when waiting helps, else 422."""
    if refusal is None:
        return
    if refusal.retry_after_s is None:
        raise ApiError(422, refusal.code, refusal.message, refusal.field)
    headers = {"Retry-After": str(refusal.retry_after_s)}
    raise ApiError(429, refusal.code, refusal.message, refusal.field, headers)
