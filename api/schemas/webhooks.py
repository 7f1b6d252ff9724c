"""Webhook schemas: subscriptions (WebhookCreate, WebhookPublic), the signing secret, deliveries and their
attempts."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from conveyor.api.schemas.fields import STORABLE
from conveyor.api.schemas.jobs import event_filter
from conveyor.core.store.tables import Attempt, Delivery, Subscription
from conveyor.core.webhooks.events import EVENT_TYPES

# What event_filter accepts, told in the schema: each type, each `<group>.*`, and `*`.
EVENT_FILTERS = ["*", *sorted({f"{t.split('.')[0]}.*" for t in EVENT_TYPES}), *EVENT_TYPES]


class WebhookCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: Annotated[str, Field(min_length=1, max_length=2048), STORABLE] = Field(
        description="https, or operator-allowlisted"
    )
    events: list[str] = Field(
        default_factory=lambda: ["*"], max_length=len(EVENT_TYPES),
        description=f"event types, '<group>.*' or '*'; types: {', '.join(EVENT_TYPES)}",
        json_schema_extra={"items": {"type": "string", "enum": EVENT_FILTERS}, "minItems": 1},
    )
    description: Annotated[str, Field(max_length=500), STORABLE] | None = None

    @field_validator("events")
    @classmethod
    def _known_events(cls, value: list[str]) -> list[str]:
        return event_filter(value)


class WebhookPublic(BaseModel):
    id: str
    url: str
    events: list[str]
    description: str | None
    enabled: bool
    disabled_reason: str | None
    created_at: datetime
    updated_at: datetime

    @classmethod
    def from_row(cls, row: Subscription) -> WebhookPublic:
        return cls(id=row.id, url=row.url, events=row.events, description=row.description,
                   enabled=row.enabled, disabled_reason=row.disabled_reason, created_at=row.created_at,
                   updated_at=row.updated_at)


class WebhookCreated(WebhookPublic):
    secret: str | None = Field(
        description="the tenant's signing secret, shown once when the first subscription creates it; "
                    "null when the tenant already has one (rotate to get a new one)"
    )


class WebhookList(BaseModel):
    data: list[WebhookPublic]


class SecretRotated(BaseModel):
    secret: str = Field(description="the new whsec_ secret; shown only now")
    previous_valid_until: datetime = Field(description="earlier secrets keep signing until then")


class AttemptPublic(BaseModel):
    number: int
    attempted_at: datetime
    outcome: str = Field(description="delivered, retry, disabled or failed")
    status_code: int | None
    duration_s: float
    error: str | None
    response_excerpt: str | None
    next_attempt_at: datetime | None

    @classmethod
    def from_row(cls, row: Attempt) -> AttemptPublic:
        return cls(number=row.number, attempted_at=row.attempted_at, outcome=row.outcome,
                   status_code=row.status_code, duration_s=row.duration_s, error=row.error,
                   response_excerpt=row.response_excerpt, next_attempt_at=row.next_attempt_at)


class DeliveryPublic(BaseModel):
    id: str = Field(description="the webhook-id header, the same on every attempt and resend")
    event_type: str
    subject_type: str
    subject_id: str
    subscription_id: str | None = Field(description="null: the job's or batch's own webhook")
    url: str
    status: str = Field(description="pending, delivered or failed")
    next_attempt_at: datetime | None
    last_error: str | None
    created_at: datetime
    attempts: list[AttemptPublic]

    @classmethod
    def from_row(cls, row: Delivery, attempts: list[Attempt]) -> DeliveryPublic:
        return cls(id=row.id, event_type=row.event_type, subject_type=row.subject_type,
                   subject_id=row.subject_id, subscription_id=row.subscription_id, url=row.url,
                   status=row.status, next_attempt_at=row.next_attempt_at, last_error=row.last_error,
                   created_at=row.created_at, attempts=[AttemptPublic.from_row(a) for a in attempts])


class DeliveryList(BaseModel):
    data: list[DeliveryPublic]
