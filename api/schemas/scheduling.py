"""When a job or a batch should start: `run_at` (an RFC 3339 time with its offset) or `delay_s`, never
both; unset, at once. A time already past starts it at once, as Celery's `eta` does."""

from __future__ import annotations

from datetime import datetime, timedelta

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from conveyor.core.clock import utcnow

MAX_SCHEDULE_S = 30 * 24 * 3600.0  # how far ahead a job may be scheduled


class ScheduleFields(BaseModel):
    run_at: AwareDatetime | None = Field(
        None, description="RFC 3339 time (with its offset) before which it must not start: it waits in "
        f"status `scheduled` until then (at most {MAX_SCHEDULE_S / 86400:g} days ahead); a past time starts "
        "it now")
    delay_s: float | None = Field(None, strict=True, gt=0, le=MAX_SCHEDULE_S, allow_inf_nan=False,
                                  description="seconds from now before which it must not start")

    @model_validator(mode="after")
    def _one_way_and_not_too_far(self) -> ScheduleFields:
        if self.run_at is not None and self.delay_s is not None:
            raise PydanticCustomError("schedule_conflict", "give run_at or delay_s, not both")
        if self.run_at is not None and self.run_at - utcnow() > timedelta(seconds=MAX_SCHEDULE_S):
            raise PydanticCustomError("schedule_too_far",
                                      f"run_at: at most {MAX_SCHEDULE_S / 86400:g} days ahead")
        return self

    def due_at(self, now: datetime) -> datetime | None:
        """When it is due; None: at once."""
        if self.delay_s is not None:
            return now + timedelta(seconds=self.delay_s)
        return self.run_at


class RetryRequest(ScheduleFields):
    """POST /v1/jobs/{id}/retry's optional body: when the job runs again (unset: at once)."""

    model_config = ConfigDict(extra="forbid")
