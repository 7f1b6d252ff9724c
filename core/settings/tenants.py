"""Every tenant's fair share and quotas unless `conveyor tenants set` gives it its own (the tenants table)."""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator


class TenantDefaults(BaseModel):
    tenant_weight: float = Field(
        1.0, gt=0, le=1e6, allow_inf_nan=False,
        description="a tenant's share of a queue's slots against the other tenants with work in it (see "
        "[Fair share and quotas](../guides/fair-share.md); `conveyor tenants set T --weight` "
        "overrides it per tenant)",
    )
    tenant_max_queued: int | None = Field(
        None, ge=1,
        description="queued jobs one tenant may have in one queue; beyond it 429 `tenant_queue_full` with "
        "`Retry-After`; unset = only the queue's `max_queued`",
    )
    tenant_max_running: int | None = Field(
        None, ge=1,
        description="running sequences (a job of n choices runs n, an embedding job one per input) one "
        "tenant may have in one queue across every worker, batch lines included; unset = no cap beyond fair "
        "share",
    )
    tenant_tokens_per_minute: int | None = Field(
        None, ge=1,
        description="prompt + output tokens of the jobs one tenant submitted in the last minute; beyond it "
        "429 `tokens_per_minute_exceeded` with `Retry-After`; unset = no limit",
    )
    tenant_min_priority: int | None = Field(
        None, ge=-(2**31 - 1), le=2**31 - 1,
        description="the most urgent `priority` a tenant's job may ask for (lower is served first; the "
        "`priority` service tier is -1); below it 403 `priority_not_permitted`; unset = any",
    )
    tenant_max_priority: int | None = Field(
        None, ge=-(2**31 - 1), le=2**31 - 1,
        description="the least urgent `priority` a tenant's job may ask for; a job asking none gets 0 "
        "brought within the range; unset = any",
    )

    @model_validator(mode="after")
    def _priority_range(self) -> TenantDefaults:
        low, high = self.tenant_min_priority, self.tenant_max_priority
        if low is not None and high is not None and low > high:
            raise ValueError(f"tenant_min_priority: {low} is above tenant_max_priority {high}")
        return self
