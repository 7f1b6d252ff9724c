"""Webhook events, created in the transaction of the change they report.

`enqueue_job_events` runs from `finished.record_finished` for the jobs whose transition applied: one
`job.<status>` event per job, delivered to each of the tenant's enabled subscriptions whose filter matches
and to the job's own `webhook` target. `data` is the job as `GET /v1/jobs/{id}` returns it, frozen now.
`enqueue_batch_event` is the same for batches; the batches store calls it when a batch ends.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.store import webhooks
from core.store.tables import Job
from core.views import JobPublic
from core.webhooks.events import build_event, matches

JOB_STATUS_EVENTS = {s: f"job.{s}" for s in ("succeeded", "failed", "cancelled", "expired")}


def enqueue_job_events(session: Session, job_ids: list[str], status: str, now: datetime) -> None:
    event_type = JOB_STATUS_EVENTS[status]
    query = select(Job).where(Job.id.in_(job_ids)).execution_options(populate_existing=True)
    for job in session.execute(query).scalars():
        data = JobPublic.from_row(job).model_dump(mode="json")
        _enqueue(session, build_event(event_type, data, now), "job", job.id, job.tenant_id, job.webhook, now)


def enqueue_batch_event(session: Session, batch_public: dict[str, Any], event_type: str, tenant_id: str,
                        webhook: dict[str, Any] | str | None, now: datetime) -> None:
    """`batch_public` is the batch as its `GET` returns it (JSON-ready); `webhook` the batch's own target
    (a URL or an object with `url`), if any. Not committed: runs inside the caller's transaction."""
    event = build_event(event_type, batch_public, now)
    _enqueue(session, event, "batch", str(batch_public["id"]), tenant_id, webhook, now)


def _enqueue(session: Session, event: dict[str, Any], subject_type: str, subject_id: str, tenant_id: str,
             own_webhook: dict[str, Any] | str | None, now: datetime) -> None:
    targets: dict[str, str | None] = {}   # url -> subscription id (None: the subject's own); one per url
    for subscription in webhooks.enabled_subscriptions(session, tenant_id):
        if matches(subscription.events, event["type"]):
            targets.setdefault(subscription.url, subscription.id)
    own_url = own_webhook if isinstance(own_webhook, str) or own_webhook is None else own_webhook.get("url")
    if own_url:
        targets.setdefault(str(own_url), None)
    for url, subscription_id in targets.items():
        webhooks.add_delivery(session, tenant_id=tenant_id, subscription_id=subscription_id, url=url,
                              event=event, subject_type=subject_type, subject_id=subject_id, now=now)
