"""Accepting a job: checks against the queue's limits, idempotency, insert; the dispatch relay publishes it
(reconciler scheme, core/dispatch.py)."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api import admission
from api.deps import Services
from api.errors import ApiError
from api.schemas.jobs import JobCreate
from api.webhook_targets import check_job_webhook
from core.model_limits import served_max_model_len
from core.request_rules import PROMPT_BYTES_PER_TOKEN, text_problem, utf8_length
from core.settings import QueueSettings
from core.store import jobs, tenants
from core.store.tables import Job
from core.store.tenants import TenantLimits

MAX_IDEMPOTENCY_KEY_CHARS = 255


def submit(
    session: Session, services: Services, tenant_id: str, body: JobCreate, idempotency_key: str | None,
    now: datetime,
) -> tuple[Job, bool]:
    """Returns (job, created); created is False when an Idempotency-Key replays an earlier submission."""
    queue = _queue(services, body.queue)
    try:
        job, created = _submit(session, services, tenant_id, body, queue, idempotency_key, now)
    except ApiError as exc:
        label = body.queue if body.queue in services.settings.queues else "unknown"
        services.metrics.jobs_rejected.labels(label, exc.code).inc()
        raise
    if created:
        services.metrics.jobs_submitted.labels(job.queue).inc()
        services.admission.admitted(job.queue, tenant_id)
        services.dispatcher.dispatch(job.id, job.queue)
    return job, created


def _submit(
    session: Session, services: Services, tenant_id: str, body: JobCreate, queue: QueueSettings,
    idempotency_key: str | None, now: datetime,
) -> tuple[Job, bool]:
    _check_body(services, body, queue)
    check_job_webhook(body.webhook_json(), services.settings)
    request_hash = _request_hash(body)
    if idempotency_key is not None:
        _check_idempotency_key(idempotency_key)
        earlier = jobs.by_idempotency_key(session, tenant_id, idempotency_key)
        if earlier is not None:
            return _replay(earlier, request_hash), False
    _admit(session, services, body.queue, queue)  # before tokenizing: an overloaded queue costs no CPU
    limits = tenants.effective_limits(session, tenant_id, TenantLimits.defaults(services.settings))
    _refuse(admission.queued_refusal(session, services.admission, limits, tenant_id, body.queue,
                                     services.settings.retry_after_s))
    prompt_tokens = _count_prompt_tokens(services, body, queue)
    _refuse(admission.tokens_refusal(session, limits, tenant_id, prompt_tokens + body.max_tokens, now))
    new = jobs.NewJob(
        tenant_id=tenant_id, queue=body.queue, prompt=body.prompt,
        messages=[m.model_dump() for m in body.messages] if body.messages else None,
        params=body.sampling_params(), meta=body.metadata, webhook=body.webhook_json(),
        idempotency_key=idempotency_key, request_hash=request_hash, prompt_tokens=prompt_tokens,
        ttl_s=body.ttl if body.ttl is not None else queue.deadline_s, timeout_s=body.timeout,
    )
    try:
        return jobs.add(session, new, now), True
    except IntegrityError:  # a concurrent submission with the same Idempotency-Key won the insert
        session.rollback()
        assert idempotency_key is not None
        earlier = jobs.by_idempotency_key(session, tenant_id, idempotency_key)
        assert earlier is not None, "an IntegrityError on insert can only be the idempotency key"
        return _replay(earlier, request_hash), False


def _queue(services: Services, name: str) -> QueueSettings:
    queue = services.settings.queue(name)
    if queue is None:
        known = ", ".join(sorted(services.settings.queues))
        services.metrics.jobs_rejected.labels("unknown", "unknown_queue").inc()
        raise ApiError(422, "unknown_queue", f"queue: unknown queue {name!r}; known queues: {known}", "queue")
    return queue


def _check_body(services: Services, body: JobCreate, queue: QueueSettings) -> None:
    if (body.prompt is None) == (body.messages is None):
        raise _invalid("invalid_request", "prompt", "exactly one of `prompt` or `messages` is required")
    _check_prompt_bytes(body, queue)
    if body.max_tokens > queue.max_output_tokens:
        raise _invalid("max_tokens_too_large", "max_tokens", f"{body.max_tokens} exceeds the {body.queue} "
                       f"queue's max_output_tokens ({queue.max_output_tokens})")
    if body.min_tokens > body.max_tokens:
        message = f"{body.min_tokens} exceeds max_tokens ({body.max_tokens})"
        raise _invalid("invalid_request", "min_tokens", message)
    if body.metadata is not None:
        size = len(json.dumps(body.metadata, separators=(",", ":")).encode())
        limit = services.settings.max_metadata_bytes
        if size > limit:
            raise _invalid("metadata_too_large", "metadata", f"{size} bytes of JSON exceeds {limit}")


def _check_prompt_bytes(body: JobCreate, queue: QueueSettings) -> None:
    """Refuses a prompt that cannot fit max_prompt_tokens by its size alone, before tokenizing it whole."""
    field = "prompt" if body.prompt is not None else "messages"
    size = prompt_bytes(body.prompt, [m.model_dump() for m in body.messages or []])
    limit = max_prompt_bytes(queue)
    if size > limit:
        raise _invalid("prompt_too_long", field, f"{size} bytes exceeds the {body.queue} queue's limit of "
                       f"{limit} bytes (max_prompt_tokens {queue.max_prompt_tokens} x "
                       f"{PROMPT_BYTES_PER_TOKEN} bytes per token)")


def prompt_bytes(prompt: str | None, messages: list[dict[str, str]]) -> int:
    """UTF-8 bytes of the prompt, or of the messages' contents (the chat template only adds to them)."""
    return utf8_length(prompt or "") + sum(utf8_length(m["content"]) for m in messages)


def max_prompt_bytes(queue: QueueSettings) -> int:
    return queue.max_prompt_tokens * PROMPT_BYTES_PER_TOKEN


def _check_idempotency_key(key: str) -> None:
    if not key or len(key) > MAX_IDEMPOTENCY_KEY_CHARS:
        limit = MAX_IDEMPOTENCY_KEY_CHARS
        raise _invalid("invalid_request", "Idempotency-Key", f"must be 1 to {limit} characters")
    problem = text_problem(key)
    if problem is not None:  # the key is stored
        raise _invalid("invalid_request", "Idempotency-Key", problem)


def _request_hash(body: JobCreate) -> str:
    canonical = json.dumps(body.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _replay(earlier: Job, request_hash: str) -> Job:
    if earlier.request_hash != request_hash:
        message = f"Idempotency-Key: already used for job {earlier.id} with a different request body"
        raise ApiError(409, "idempotency_conflict", message, "Idempotency-Key")
    return earlier


def _count_prompt_tokens(services: Services, body: JobCreate, queue: QueueSettings) -> int:
    field = "prompt" if body.prompt is not None else "messages"
    try:
        if body.prompt is not None:
            n = services.tokenizer.count_prompt(body.prompt)
        else:
            assert body.messages is not None
            n = services.tokenizer.count_messages([m.model_dump() for m in body.messages])
    except ValueError as exc:
        raise ApiError(422, "invalid_request", str(exc), field) from exc
    if n > queue.max_prompt_tokens:
        raise _invalid("prompt_too_long", field, f"{n} tokens exceeds the {body.queue} queue's "
                       f"max_prompt_tokens ({queue.max_prompt_tokens})")
    max_model_len = model_max_len(services)
    if max_model_len is not None and n + body.max_tokens > max_model_len:
        raise _invalid("context_too_long", "max_tokens", f"{n} prompt tokens + max_tokens {body.max_tokens} "
                       f"exceeds max_model_len ({max_model_len})")
    return n


def model_max_len(services: Services) -> int | None:
    """The max_model_len the workers serve: the configured one, else the model's own (its config.json),
    so a request that can never run is refused here rather than failing on a worker."""
    return served_max_model_len(services.settings.max_model_len, services.tokenizer.context_length)


def _admit(session: Session, services: Services, name: str, queue: QueueSettings) -> None:
    # NOTE: a soft cap, estimated per process (api/admission.py; README, "Admission control").
    if not services.admission.has_room(session, name, queue.max_queued):
        retry_after = str(services.settings.retry_after_s)
        message = f"queue: the {name} queue is full ({queue.max_queued} queued); retry after {retry_after} s"
        raise ApiError(429, "queue_full", message, "queue", {"Retry-After": retry_after})


def _refuse(refusal: admission.Refusal | None) -> None:
    """A tenant quota's refusal as the HTTP error: 429 with Retry-After when waiting helps, else 422."""
    if refusal is None:
        return
    if refusal.retry_after_s is None:
        raise ApiError(422, refusal.code, refusal.message, refusal.field)
    headers = {"Retry-After": str(refusal.retry_after_s)}
    raise ApiError(429, refusal.code, refusal.message, refusal.field, headers)


def _invalid(code: str, field: str, message: str) -> ApiError:
    return ApiError(422, code, f"{field}: {message}", field)
