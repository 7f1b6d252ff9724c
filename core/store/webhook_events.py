"""Webhook events, created in the transaction of the change they report.

`enqueue_job_events` runs from `final_status_effects.record_finished` for the jobs whose transition
applied: one `job.<status>` event per job, delivered to each of the tenant's enabled subscriptions whose
filter matches and to the job's own `webhook` target. `data` is the job as `GET /v1/jobs/{id}` returns
it, frozen now. `enqueue_batch_event` is the same for batches; the batches store calls it when a batch ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Row, exists, literal_column, select
from sqlalchemy.orm import Session, aliased

from conveyor.core.lifecycle import CANCELLED, SUCCEEDED
from conveyor.core.store import webhooks
from conveyor.core.store.tables import Job, Subscription
from conveyor.core.views.public import JobPublic
from conveyor.core.views.response_objects import response_object
from conveyor.core.webhooks.events import JOB_STARTED, build_event, matches

JOB_STATUS_EVENTS = {s: f"job.{s}" for s in ("succeeded", "failed", "cancelled", "expired")}

_TENANT_SUBSCRIPTIONS = aliased(Subscription, name="tenant_subscriptions")
# Whether a job's tenant has an enabled subscription: a column of any statement on `jobs` (a read, a claim's
# RETURNING), so that the subscriptions themselves are read only for the tenants that have some. The jobs
# table is named by hand: SQLite writes a RETURNING clause's columns unqualified, and an unqualified
# tenant_id inside the subquery would be the subscription's own.
TENANT_SUBSCRIBED = exists().where(_TENANT_SUBSCRIPTIONS.tenant_id == literal_column("jobs.tenant_id"),
                                   _TENANT_SUBSCRIPTIONS.enabled.is_(True)).label("subscribed")


def enqueue_job_events(session: Session, finished: Sequence[Row[Any]], status: str, now: datetime) -> None:
    """One event per job of `finished` (rows with id, tenant_id, webhook, finish_reason, is_response and
    subscribed: TENANT_SUBSCRIBED); the subscriptions of the group's tenants that have some are read once,
    in one query. A response's job sends its response's event (`response.completed`, ...: the response
    object), any other job `job.<status>` (the job)."""
    subscribed = webhooks.enabled_subscriptions_of(session, {row.tenant_id for row in finished
                                                             if row.subscribed})
    event_types = {row.id: _event_type(row, status) for row in finished}
    to_send = {row.id: targets for row in finished
               if (targets := _targets(subscribed.get(row.tenant_id, []), event_types[row.id], row.webhook))}
    if not to_send:
        return
    query = select(Job).where(Job.id.in_(list(to_send))).execution_options(populate_existing=True)
    for job in session.execute(query).scalars():  # the event is the job as its GET shows it, frozen now
        event = build_event(event_types[job.id], _shown(job), now)
        _add_deliveries(session, to_send[job.id], event, "job", job.id, job.tenant_id, now)


def _shown(job: Job) -> dict[str, Any]:
    """The job as its GET shows it: its response's, or the job's own."""
    if job.responses_request is not None:
        return response_object(job)
    return JobPublic.from_row(job).model_dump(mode="json")


def _event_type(row: Row[Any], status: str) -> str:
    if not row.is_response:
        return JOB_STATUS_EVENTS[status]
    if status == SUCCEEDED:
        return "response.incomplete" if row.finish_reason == "length" else "response.completed"
    return "response.cancelled" if status == CANCELLED else "response.failed"


def enqueue_started_events(session: Session, claimed: Sequence[Job | Row[Any]], now: datetime,
                           subscribed_tenants: set[str] | None = None) -> None:
    """`job.started` for each claimed job with a target that asked for it (core/webhooks/events.py: opt-in),
    in the claim's transaction: one query for the claimed tenants' subscriptions (only those of
    `subscribed_tenants`, when the claim read which have some: TENANT_SUBSCRIBED), and nothing more unless a
    target wants the event. `claimed`: rows with id, tenant_id and webhook (a claim's rows hold only some
    columns: the jobs with a target are read whole)."""
    tenants = {job.tenant_id for job in claimed} if subscribed_tenants is None else subscribed_tenants
    subscribed = webhooks.enabled_subscriptions_of(session, tenants)
    to_send = {job.id: targets for job in claimed
               if (targets := _targets(subscribed.get(job.tenant_id, []), JOB_STARTED, job.webhook))}
    if not to_send:
        return
    query = select(Job).where(Job.id.in_(list(to_send))).execution_options(populate_existing=True)
    shown = {job.id: job for job in session.execute(query).scalars()}
    for job_id, targets in to_send.items():
        job = shown[job_id]
        event = build_event(JOB_STARTED, JobPublic.from_row(job).model_dump(mode="json"), now)
        _add_deliveries(session, targets, event, "job", job.id, job.tenant_id, now)


def enqueue_batch_event(session: Session, batch_public: dict[str, Any], event_type: str, tenant_id: str,
                        webhook: dict[str, Any] | str | None, now: datetime) -> None:
    """`batch_public` is the batch as its `GET` returns it (JSON-ready); `webhook` the batch's own target
    (a URL or an object with `url`), if any. Not committed: runs inside the caller's transaction."""
    subscribed = webhooks.enabled_subscriptions_of(session, {tenant_id}).get(tenant_id, [])
    targets = _targets(subscribed, event_type, webhook)
    event = build_event(event_type, batch_public, now)
    _add_deliveries(session, targets, event, "batch", str(batch_public["id"]), tenant_id, now)


def _targets(subscribed: list[Subscription], event_type: str, own_webhook: dict[str, Any] | str | None,
             ) -> dict[str, str | None]:
    """url -> subscription id (None: the subject's own target); one delivery per url."""
    targets: dict[str, str | None] = {}
    for subscription in subscribed:
        if matches(subscription.events, event_type):
            targets.setdefault(subscription.url, subscription.id)
    own_url = own_webhook if isinstance(own_webhook, str) or own_webhook is None else own_webhook.get("url")
    own_filter = own_webhook.get("events") if isinstance(own_webhook, dict) else None
    if own_url and matches(own_filter or [], event_type):
        targets.setdefault(str(own_url), None)
    return targets


def _add_deliveries(session: Session, targets: dict[str, str | None], event: dict[str, Any],
                    subject_type: str, subject_id: str, tenant_id: str, now: datetime) -> None:
    for url, subscription_id in targets.items():
        webhooks.add_delivery(session, tenant_id=tenant_id, subscription_id=subscription_id, url=url,
                              event=event, subject_type=subject_type, subject_id=subject_id, now=now)
