"""A queue's limits: each queue of a model maps onto an engine request class of the same name."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, Field, model_validator

from conveyor.core.protocol.request_rules import MAX_TTL_S

log = logging.getLogger(__name__)


class QueueSettings(BaseModel):
    """Limits of one queue; each queue maps onto an engine request class of the same name."""

    @model_validator(mode="before")
    @classmethod
    def _former_names(cls, data: Any) -> Any:
        return renamed_queue_fields(data) if isinstance(data, dict) else data

    max_queued: int = Field(
        1000, ge=1,
        description="submissions beyond this many queued jobs get 429 (approximate: estimated per API "
        "process, see Admission control)",
    )
    max_running: int = Field(16, ge=1, description="jobs of this queue inside one worker's engine at once")
    max_prompt_tokens: int = Field(
        2048, ge=1,
        description="longest prompt accepted (model tokenizer); prompts over 32 bytes per token are refused "
        "untokenized",
    )
    max_output_tokens: int = Field(512, ge=1, description="largest `max_tokens` accepted")
    priority: int = Field(0, description="engine class priority; lower is served first")
    default_ttl_s: float | None = Field(
        None, gt=0, le=MAX_TTL_S, allow_inf_nan=False,
        description="`ttl` of a job that sets none: a job not started within it expires (formerly "
        "`deadline_s`, still read, with a warning)",
    )
    default_deadline_s: float | None = Field(
        None, gt=0, le=MAX_TTL_S, allow_inf_nan=False,
        description="`deadline_s` of a job that sets none (a soft target the schedulers order by); unset: "
        "such jobs have no deadline",
    )
    max_retries: int | None = Field(
        None, ge=0, le=10,
        description="`max_retries` of a job that sets none: automatic retries after a worker was lost, the "
        "engine ran out of memory or the model was not loadable yet; unset: max_attempts - 1 for a lost "
        "worker, 2 otherwise",
    )


def renamed_queue_fields(given: dict[str, Any]) -> dict[str, Any]:
    """A queue's fields under their current names: `deadline_s` meant the default ttl, and is read as
    `default_ttl_s`, with a warning."""
    if "deadline_s" not in given:
        return given
    given = dict(given)
    value = given.pop("deadline_s")
    if given.get("default_ttl_s") is not None:
        raise ValueError("deadline_s: the former name of default_ttl_s; set only default_ttl_s")
    log.warning("queue setting deadline_s is now named default_ttl_s (a job's default ttl); deadline_s is "
                "read as default_ttl_s, rename it")
    return {**given, "default_ttl_s": value}


def default_queues() -> dict[str, QueueSettings]:
    return {
        "interactive": QueueSettings(max_queued=1000, max_running=16, max_prompt_tokens=2048,
                                     max_output_tokens=512, priority=0, default_ttl_s=600.0),
        "documents": QueueSettings(max_queued=10000, max_running=4, max_prompt_tokens=32768,
                                   max_output_tokens=4096, priority=1, default_ttl_s=86400.0),
    }
