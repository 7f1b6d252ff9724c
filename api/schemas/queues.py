"""Queue schemas: QueuePublic and QueueList."""

from __future__ import annotations

from pydantic import BaseModel, Field

from core.settings import QueueSettings


class QueuePublic(BaseModel):
    name: str
    queued: int
    running: int
    oldest_queued_age_s: float | None
    workers: int = Field(description="live workers consuming this queue (0: jobs wait until one starts)")
    limits: QueueSettings


class QueueList(BaseModel):
    data: list[QueuePublic]
