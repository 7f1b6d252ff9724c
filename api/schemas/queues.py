"""Queue schemas: QueuePublic and QueueList."""

from __future__ import annotations

from pydantic import BaseModel

from core.settings import QueueSettings


class QueuePublic(BaseModel):
    name: str
    queued: int
    running: int
    oldest_queued_age_s: float | None
    limits: QueueSettings


class QueueList(BaseModel):
    data: list[QueuePublic]
