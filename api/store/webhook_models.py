"""Webhook tables: per-tenant signing secrets, subscriptions, deliveries (one per event and target) and
every delivery attempt. `migrations/versions/0002_webhooks.py` creates them."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Boolean, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from api.store.models import Base, UTCDateTime

PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"
DELIVERY_STATUSES = (PENDING, DELIVERED, FAILED)


class SigningSecret(Base):
    """A tenant's `whsec_` secret. The current one has no `expires_at`; a rotated-out one keeps signing until
    its `expires_at`. Stored retrievably because it must sign; shown to the tenant only when created."""

    __tablename__ = "webhook_secrets"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    secret: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)

    def __repr__(self) -> str:   # never the secret
        return f"SigningSecret(id={self.id!r}, tenant_id={self.tenant_id!r}, expires_at={self.expires_at!r})"


class Subscription(Base):
    __tablename__ = "webhook_subscriptions"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    url: Mapped[str] = mapped_column(Text)
    events: Mapped[list[str]] = mapped_column(JSON)   # filter patterns; empty = every event
    description: Mapped[str | None] = mapped_column(Text, nullable=True)
    enabled: Mapped[bool] = mapped_column(Boolean)
    disabled_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class Delivery(Base):
    """One event to one target. `id` is the `webhook-id` header, the same on every attempt and resend."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
        Index("ix_webhook_deliveries_subject", "tenant_id", "subject_type", "subject_id"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64))
    subscription_id: Mapped[str | None] = mapped_column(String(40), nullable=True)   # None: the job's own
    url: Mapped[str] = mapped_column(Text)
    event_type: Mapped[str] = mapped_column(String(32))
    subject_type: Mapped[str] = mapped_column(String(16))   # "job" or "batch"
    subject_id: Mapped[str] = mapped_column(String(64))
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)   # the event, frozen when it happened
    status: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(Integer)           # attempts started (claimed)
    schedule_start: Mapped[int] = mapped_column(Integer)     # attempts before the current retry schedule
    next_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class Attempt(Base):
    __tablename__ = "webhook_attempts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    delivery_id: Mapped[str] = mapped_column(ForeignKey("webhook_deliveries.id"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    attempted_at: Mapped[datetime] = mapped_column(UTCDateTime())
    outcome: Mapped[str] = mapped_column(String(16))   # delivered | retry | disabled | failed
    status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    duration_s: Mapped[float] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    response_excerpt: Mapped[str | None] = mapped_column(Text, nullable=True)
    next_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
