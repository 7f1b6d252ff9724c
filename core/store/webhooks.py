"""Webhook queries: signing secrets and their rotation, subscriptions, deliveries and their attempts.

A delivery is sent by whoever claims it: `claim` is one conditional UPDATE on (status, attempts,
next_attempt_at), so two sender processes never send the same attempt. Claiming pushes `next_attempt_at`
to a lease, so a sender that dies mid-attempt leaves the delivery to be claimed again after it. `record`
stores the attempt and the next schedule, conditional on the attempt number it claimed.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from conveyor.core.lifecycle import DELIVERY_DELIVERED, DELIVERY_FAILED, DELIVERY_PENDING
from conveyor.core.store import outcome_counts
from conveyor.core.store.tables import Attempt, Delivery, SigningSecret, Subscription
from conveyor.core.webhooks.delivery_attempt import AttemptResult
from conveyor.core.webhooks.signing import generate_secret


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


# --- secrets -----------------------------------------------------------------------------------------


def active_secrets(session: Session, tenant_id: str, now: datetime) -> list[str]:
    """The secret values that sign at `now`, newest first: the current one and any still in rotation."""
    query = (
        select(SigningSecret.secret)
        .where(SigningSecret.tenant_id == tenant_id)
        .where((SigningSecret.expires_at.is_(None)) | (SigningSecret.expires_at > now))
        .order_by(SigningSecret.created_at.desc(), SigningSecret.id.desc())
    )
    return list(session.execute(query).scalars())


def ensure_secret(session: Session, tenant_id: str, now: datetime) -> str | None:
    """Creates the tenant's first secret (not committed) and returns it; None when it already has one."""
    query = select(SigningSecret.id).where(SigningSecret.tenant_id == tenant_id).limit(1)
    if session.execute(query).first() is not None:
        return None
    return _add_secret(session, tenant_id, now)


def rotate_secret(session: Session, tenant_id: str, now: datetime, window: timedelta) -> str:
    """A new current secret; the previous current one keeps signing until `now + window`. Commits."""
    session.execute(
        update(SigningSecret)
        .where(SigningSecret.tenant_id == tenant_id, SigningSecret.expires_at.is_(None))
        .values(expires_at=now + window)
    )
    value = _add_secret(session, tenant_id, now)
    session.commit()
    return value


def _add_secret(session: Session, tenant_id: str, now: datetime) -> str:
    value = generate_secret()
    session.add(SigningSecret(id=_new_id("whs_"), tenant_id=tenant_id, secret=value, created_at=now))
    session.flush()
    return value


# --- subscriptions -----------------------------------------------------------------------------------


def create_subscription(session: Session, tenant_id: str, url: str, events: list[str],
                        description: str | None, now: datetime) -> tuple[Subscription, str | None]:
    """The new subscription and, when the tenant had no secret yet, its new secret. Commits."""
    secret = ensure_secret(session, tenant_id, now)
    subscription = Subscription(
        id=_new_id("whk_"), tenant_id=tenant_id, url=url, events=events, description=description,
        enabled=True, disabled_reason=None, created_at=now, updated_at=now,
    )
    session.add(subscription)
    session.commit()
    return subscription, secret


def subscriptions(session: Session, tenant_id: str) -> list[Subscription]:
    query = select(Subscription).where(Subscription.tenant_id == tenant_id)
    return list(session.execute(query.order_by(Subscription.created_at, Subscription.id)).scalars())


def enabled_subscriptions_of(session: Session, tenant_ids: set[str]) -> dict[str, list[Subscription]]:
    """Each tenant's enabled subscriptions, oldest first, in one query (tenants without any are absent)."""
    if not tenant_ids:
        return {}
    query = (select(Subscription)
             .where(Subscription.tenant_id.in_(sorted(tenant_ids)), Subscription.enabled.is_(True))
             .order_by(Subscription.created_at, Subscription.id))
    by_tenant: dict[str, list[Subscription]] = {}
    for subscription in session.execute(query).scalars():
        by_tenant.setdefault(subscription.tenant_id, []).append(subscription)
    return by_tenant


def subscription(session: Session, tenant_id: str, subscription_id: str) -> Subscription | None:
    query = select(Subscription).where(Subscription.id == subscription_id,
                                       Subscription.tenant_id == tenant_id)
    return session.execute(query.execution_options(populate_existing=True)).scalar_one_or_none()


def delete_subscription(session: Session, tenant_id: str, subscription_id: str, now: datetime) -> bool:
    """Deletes it and stops its pending deliveries (their attempts stay listable). Commits."""
    found = subscription(session, tenant_id, subscription_id)
    if found is None:
        return False
    _stop_pending(session, subscription_id, "subscription deleted", now)
    session.delete(found)
    session.commit()
    return True


def enable_subscription(session: Session, tenant_id: str, subscription_id: str,
                        now: datetime) -> Subscription | None:
    found = subscription(session, tenant_id, subscription_id)
    if found is not None:
        found.enabled, found.disabled_reason, found.updated_at = True, None, now
        session.commit()
    return found


def disable_subscription(session: Session, subscription_id: str, reason: str, now: datetime) -> None:
    """Disabled (e.g. the target answered 410 Gone): no new deliveries, pending ones stop. Not committed."""
    session.execute(
        update(Subscription).where(Subscription.id == subscription_id)
        .values(enabled=False, disabled_reason=reason, updated_at=now)
    )
    _stop_pending(session, subscription_id, f"subscription disabled: {reason}", now)


def _stop_pending(session: Session, subscription_id: str, reason: str, now: datetime) -> None:
    session.execute(
        update(Delivery)
        .where(Delivery.subscription_id == subscription_id, Delivery.status == DELIVERY_PENDING)
        .values(status=DELIVERY_FAILED, next_attempt_at=None, last_error=reason, updated_at=now)
    )


# --- deliveries --------------------------------------------------------------------------------------


def add_delivery(session: Session, *, tenant_id: str, subscription_id: str | None, url: str,
                 event: dict[str, Any], subject_type: str, subject_id: str, now: datetime) -> Delivery:
    """A pending delivery due now, inside the caller's transaction (not committed)."""
    delivery = Delivery(
        id=_new_id("msg_"), tenant_id=tenant_id, subscription_id=subscription_id, url=url,
        event_type=event["type"], subject_type=subject_type, subject_id=subject_id, payload=event,
        status=DELIVERY_PENDING, attempts=0, schedule_start=0, next_attempt_at=now, created_at=now,
        updated_at=now,
    )
    session.add(delivery)
    return delivery


class Due(NamedTuple):
    id: str
    attempts: int   # attempts so far: the claim is conditional on it
    url: str


def due(session: Session, now: datetime, limit: int, exclude_urls: Collection[str] = ()) -> list[Due]:
    """Pending deliveries due at `now`, oldest due first, leaving out those to `exclude_urls` (receivers the
    caller is already busy with, so their backlog cannot fill `limit` and starve the others)."""
    query = (
        select(Delivery.id, Delivery.attempts, Delivery.url)
        .where(Delivery.status == DELIVERY_PENDING, Delivery.next_attempt_at <= now)
        .order_by(Delivery.next_attempt_at, Delivery.id).limit(limit)
    )
    if exclude_urls:
        query = query.where(Delivery.url.not_in(list(exclude_urls)))
    return [Due(delivery_id, attempts, url) for delivery_id, attempts, url in session.execute(query)]


def claim(session: Session, delivery_id: str, attempts: int, now: datetime,
          lease_until: datetime) -> Delivery | None:
    """Takes attempt `attempts + 1` of a due delivery; None when another sender took it first. Commits."""
    result = session.execute(
        update(Delivery)
        .where(Delivery.id == delivery_id, Delivery.status == DELIVERY_PENDING, Delivery.attempts == attempts,
               Delivery.next_attempt_at <= now)
        .values(attempts=attempts + 1, next_attempt_at=lease_until, updated_at=now)
    )
    session.commit()
    if result.rowcount != 1:  # type: ignore[attr-defined]
        return None
    return _get(session, delivery_id)


def record(session: Session, delivery: Delivery, number: int, result: AttemptResult, now: datetime) -> bool:
    """Stores attempt `number` and what follows it; False (nothing stored) when the claim was lost. Commits.
    A 410 answer disables the delivery's subscription."""
    status = {"delivered": DELIVERY_DELIVERED, "retry": DELIVERY_PENDING}.get(result.outcome, DELIVERY_FAILED)
    applied = session.execute(
        update(Delivery)
        .where(Delivery.id == delivery.id, Delivery.attempts == number, Delivery.status == DELIVERY_PENDING)
        .values(status=status, next_attempt_at=result.next_attempt_at if status == DELIVERY_PENDING else None,
                last_error=result.error, updated_at=now)
    ).rowcount == 1  # type: ignore[attr-defined]
    if applied:
        session.add(_attempt_row(delivery.id, number, result))
        outcome_counts.record_webhook_attempt(session, result.outcome)
        if result.outcome == "disabled" and delivery.subscription_id is not None:
            reason = f"target answered HTTP {result.status_code}"
            disable_subscription(session, delivery.subscription_id, reason, now)
    session.commit()
    return applied


def resend(session: Session, tenant_id: str, delivery_id: str, now: datetime) -> Delivery | None:
    """Sends the delivery again now, with a fresh retry schedule and the same `webhook-id`. Commits."""
    delivery = _get(session, delivery_id)
    if delivery is None or delivery.tenant_id != tenant_id:
        return None
    session.execute(
        update(Delivery).where(Delivery.id == delivery_id)
        .values(status=DELIVERY_PENDING, schedule_start=Delivery.attempts, next_attempt_at=now,
                updated_at=now)
    )
    session.commit()
    return _get(session, delivery_id)


def delivery(session: Session, tenant_id: str, delivery_id: str) -> Delivery | None:
    found = _get(session, delivery_id)
    return found if found is not None and found.tenant_id == tenant_id else None


def for_subject(session: Session, tenant_id: str, subject_type: str, subject_id: str) -> list[Delivery]:
    """Every delivery about one job or batch (`subject_type` "job" or "batch"), oldest first."""
    query = select(Delivery).where(
        Delivery.tenant_id == tenant_id, Delivery.subject_type == subject_type,
        Delivery.subject_id == subject_id,
    )
    return list(session.execute(query.order_by(Delivery.created_at, Delivery.id)).scalars())


def attempts_of(session: Session, delivery_ids: list[str]) -> dict[str, list[Attempt]]:
    """Each delivery's attempts in order."""
    out: dict[str, list[Attempt]] = {delivery_id: [] for delivery_id in delivery_ids}
    if not delivery_ids:
        return out
    query = select(Attempt).where(Attempt.delivery_id.in_(delivery_ids)).order_by(Attempt.number, Attempt.id)
    for row in session.execute(query).scalars():
        out[row.delivery_id].append(row)
    return out


# --- deleting ------------------------------------------------------------------------------------------


def delete_for_subjects(session: Session, tenant_id: str, subject_type: str, subject_ids: list[str]) -> int:
    """Deletes the deliveries about these jobs or batches, with their attempts; no commit. Returns how many
    deliveries went."""
    if not subject_ids:
        return 0
    query = select(Delivery.id).where(Delivery.tenant_id == tenant_id, Delivery.subject_type == subject_type,
                                      Delivery.subject_id.in_(subject_ids))
    return delete_deliveries(session, list(session.execute(query).scalars()))


def delete_deliveries(session: Session, delivery_ids: list[str]) -> int:
    """Deletes these deliveries and their attempts (children first: no ON DELETE CASCADE); no commit."""
    if not delivery_ids:
        return 0
    session.execute(delete(Attempt).where(Attempt.delivery_id.in_(delivery_ids)))
    result = session.execute(delete(Delivery).where(Delivery.id.in_(delivery_ids)))
    return int(result.rowcount)  # type: ignore[attr-defined]


def _get(session: Session, delivery_id: str) -> Delivery | None:
    query = select(Delivery).where(Delivery.id == delivery_id).execution_options(populate_existing=True)
    return session.execute(query).scalar_one_or_none()


def _attempt_row(delivery_id: str, number: int, result: AttemptResult) -> Attempt:
    return Attempt(
        delivery_id=delivery_id, number=number, attempted_at=result.attempted_at, outcome=result.outcome,
        status_code=result.status_code, duration_s=result.duration_s, error=result.error,
        response_excerpt=result.response_excerpt, next_attempt_at=result.next_attempt_at,
    )
