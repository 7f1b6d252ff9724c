"""Queue schemas: QueuePublic, TenantQueueLimits and QueueList."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from conveyor.core.settings import QueueSettings


class TenantQueueLimits(BaseModel):
    """The tenant's own limits in one queue: the settings' defaults or its overrides (`conveyor tenants
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
    model: str = Field(description="the served model whose queue this is (each model has its own)")
    queued: int = Field(description="queued jobs: the tenant's (every tenant's with an admin key)")
    running: int = Field(description="running jobs: the tenant's (every tenant's with an admin key)")
    scheduled: int = Field(0, description="scheduled jobs not due yet, the same tenant's (not in `queued`, "
                           "nor in the scaling signal, until due)")
    oldest_queued_age_s: float | None = Field(description="age of the oldest of those queued jobs")
    workers: int = Field(description="live workers consuming this queue (0: jobs wait until one starts)")
    limits: QueueSettings = Field(description="the queue's own limits, the same for every tenant")
    tenant_limits: TenantQueueLimits
    deadlines_last_hour: DeadlineCounts = Field(
        description="goodput: the same jobs' (the tenant's, or every tenant's) with a deadline that ended in "
        "the last hour, by outcome")
    deadlines_last_hour_by_tier: dict[str, DeadlineCounts] = Field(
        description="deadlines_last_hour per service tier (default: none, auto or default; flex; priority), "
        "only the tiers that had such jobs")


class Purged(BaseModel):
    queue: str
    cancelled: int = Field(description="the queued and scheduled jobs the purge cancelled")
    tenant: str | None = Field(description="whose jobs: the caller's; null: every tenant's (an admin key, or "
                               "auth off)")


class QueueList(BaseModel):
    data: list[QueuePublic]
    scope: Literal["tenant", "all"] = Field(
        description="tenant: the counts are `tenant`'s jobs; all: every tenant's (admin key, or auth off, "
        "without `?tenant=`)"
    )
    tenant: str = Field(description="the tenant the listing is for: the caller's, or the one an admin key "
                        "(or auth off) named with `?tenant=`; its limits and token use are shown")
    tokens_per_minute: int | None = Field(description="the tenant's limit on prompt + output tokens a minute")
    tokens_used_last_minute: int = Field(
        description="prompt + max_tokens of the tenant's jobs submitted in the last minute that have not "
        "finished, prompt + generated tokens of those that have"
    )
