"""Queue schemas: QueuePublic, TenantQueueLimits and QueueList."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from core.settings import QueueSettings


class TenantQueueLimits(BaseModel):
    """The caller's own limits in one queue: the settings' defaults or its overrides (`conveyor tenants
    set`); null: no limit of that kind beyond the queue's."""

    weight: float = Field(description="its share of the queue's slots against other tenants with work in it")
    max_queued: int | None = Field(description="its queued jobs in this queue; submits beyond get 429")
    max_running: int | None = Field(description="its running jobs in this queue, across every worker")


class DeadlineCounts(BaseModel):
    """Jobs with a deadline that ended in the last hour: succeeded by it, succeeded after it, or not."""

    on_time: int = 0
    late: int = 0
    missed: int = 0


class QueuePublic(BaseModel):
    name: str
    queued: int = Field(description="queued jobs: the caller's own (every tenant's with an admin key)")
    running: int = Field(description="running jobs: the caller's own (every tenant's with an admin key)")
    oldest_queued_age_s: float | None = Field(description="age of the oldest of those queued jobs")
    workers: int = Field(description="live workers consuming this queue (0: jobs wait until one starts)")
    limits: QueueSettings = Field(description="the queue's own limits, the same for every tenant")
    tenant_limits: TenantQueueLimits
    deadlines_last_hour: DeadlineCounts = Field(
        description="goodput: the same jobs' (the caller's, or every tenant's) with a deadline that ended in "
        "the last hour, by outcome")


class QueueList(BaseModel):
    data: list[QueuePublic]
    scope: Literal["tenant", "all"] = Field(
        description="tenant: the counts are the caller's jobs; all: every tenant's (admin key, or auth off)"
    )
    tenant: str = Field(description="the caller's tenant")
    tokens_per_minute: int | None = Field(description="the caller's limit on prompt + output tokens a minute")
    tokens_used_last_minute: int = Field(
        description="prompt + max_tokens of the caller's jobs submitted in the last minute that have not "
        "finished, prompt + generated tokens of those that have"
    )
