"""/v1/webhooks: subscriptions, the signing secret, deliveries (listed per job or batch, re-sent by id)."""

from __future__ import annotations

from datetime import timedelta

from fastapi import APIRouter, Response
from sqlalchemy.orm import Session

from conveyor.api.auth import CurrentTenant
from conveyor.api.deps import ServicesDep, SessionDep
from conveyor.api.errors import lookup_id, not_found
from conveyor.api.schemas.errors import error_responses
from conveyor.api.schemas.webhooks import (
    DeliveryList,
    DeliveryPublic,
    SecretRotated,
    WebhookCreate,
    WebhookCreated,
    WebhookList,
    WebhookPublic,
)
from conveyor.api.webhook_targets import check_webhook_target
from conveyor.core.clock import utcnow
from conveyor.core.store import batches, jobs, webhooks

router = APIRouter(tags=["webhooks"])
BY_ID = error_responses(401, 404)


@router.post("/v1/webhooks", status_code=201, response_model=WebhookCreated,
             responses=error_responses(401, 413, 422))
def create_webhook(body: WebhookCreate, session: SessionDep, services: ServicesDep,
                   tenant: CurrentTenant) -> WebhookCreated:
    """Subscribes `url` to the events matching `events`. The tenant's first subscription returns the signing
    secret, once."""
    check_webhook_target(body.url, services.settings, "url")
    row, secret = webhooks.create_subscription(session, tenant, body.url, body.events, body.description,
                                               utcnow())
    return WebhookCreated(**WebhookPublic.from_row(row).model_dump(), secret=secret)


@router.get("/v1/webhooks", response_model=WebhookList, responses=error_responses(401))
def list_webhooks(session: SessionDep, tenant: CurrentTenant) -> WebhookList:
    return WebhookList(data=[WebhookPublic.from_row(row) for row in webhooks.subscriptions(session, tenant)])


@router.post("/v1/webhooks/secret/rotate", response_model=SecretRotated, responses=error_responses(401))
def rotate_secret(session: SessionDep, services: ServicesDep, tenant: CurrentTenant) -> SecretRotated:
    """A new signing secret, shown only in this answer. Earlier secrets keep signing (each delivery carries
    one signature per secret) for webhook_rotation_window_s."""
    now = utcnow()
    window = timedelta(seconds=services.settings.webhook_rotation_window_s)
    secret = webhooks.rotate_secret(session, tenant, now, window)
    return SecretRotated(secret=secret, previous_valid_until=now + window)


@router.get("/v1/webhooks/{webhook_id}", response_model=WebhookPublic, responses=BY_ID)
def get_webhook(webhook_id: str, session: SessionDep, tenant: CurrentTenant) -> WebhookPublic:
    row = webhooks.subscription(session, tenant, lookup_id("webhook", webhook_id))
    if row is None:
        raise not_found("webhook", webhook_id)
    return WebhookPublic.from_row(row)


@router.delete("/v1/webhooks/{webhook_id}", status_code=204, responses=BY_ID)
def delete_webhook(webhook_id: str, session: SessionDep, tenant: CurrentTenant) -> Response:
    """Deletes the subscription; its pending deliveries stop, its attempts stay listable."""
    if not webhooks.delete_subscription(session, tenant, lookup_id("webhook", webhook_id), utcnow()):
        raise not_found("webhook", webhook_id)
    return Response(status_code=204)


@router.post("/v1/webhooks/{webhook_id}/enable", response_model=WebhookPublic, responses=BY_ID)
def enable_webhook(webhook_id: str, session: SessionDep, tenant: CurrentTenant) -> WebhookPublic:
    """Re-enables a subscription disabled by a 410 answer; deliveries it missed can be re-sent."""
    row = webhooks.enable_subscription(session, tenant, lookup_id("webhook", webhook_id), utcnow())
    if row is None:
        raise not_found("webhook", webhook_id)
    return WebhookPublic.from_row(row)


@router.post("/v1/webhooks/deliveries/{delivery_id}/resend", status_code=202, response_model=DeliveryPublic,
             responses=BY_ID)
def resend_delivery(delivery_id: str, session: SessionDep, tenant: CurrentTenant) -> DeliveryPublic:
    """Sends the delivery again, with the same webhook-id and body and a fresh retry schedule."""
    row = webhooks.resend(session, tenant, lookup_id("delivery", delivery_id), utcnow())
    if row is None:
        raise not_found("delivery", delivery_id)
    return DeliveryPublic.from_row(row, webhooks.attempts_of(session, [row.id])[row.id])


@router.get("/v1/jobs/{job_id}/deliveries", response_model=DeliveryList, responses=BY_ID)
def job_deliveries(job_id: str, session: SessionDep, tenant: CurrentTenant) -> DeliveryList:
    """Every webhook delivery about the job, each with all its attempts."""
    if jobs.get(session, lookup_id("job", job_id), tenant) is None:
        raise not_found("job", job_id)
    return delivery_list(session, tenant, "job", job_id)


@router.get("/v1/batches/{batch_id}/deliveries", response_model=DeliveryList, responses=BY_ID)
def batch_deliveries(batch_id: str, session: SessionDep, tenant: CurrentTenant) -> DeliveryList:
    """Every webhook delivery about the batch, each with all its attempts."""
    if batches.get(session, lookup_id("batch", batch_id), tenant) is None:
        raise not_found("batch", batch_id)
    return delivery_list(session, tenant, "batch", batch_id)


def delivery_list(session: Session, tenant_id: str, subject_type: str, subject_id: str) -> DeliveryList:
    """The deliveries about one job or batch."""
    rows = webhooks.for_subject(session, tenant_id, subject_type, subject_id)
    attempts = webhooks.attempts_of(session, [row.id for row in rows])
    return DeliveryList(data=[DeliveryPublic.from_row(row, attempts[row.id]) for row in rows])
