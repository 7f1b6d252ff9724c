"""LoRA adapters as the service sees them: each is served under its own id (the `model` clients send) by
its base model's workers, in its base model's lanes. A job for an adapter is queued in the base model's lane
and names the adapter in its params under LORA_PARAM; the worker hands that to its engine
(engine/lora/)."""

from __future__ import annotations

from typing import Any

from conveyor.core.lanes import model_of
from conveyor.core.protocol.job_params import JobParams

LORA_PARAM = "lora"  # a job's params key (JobParams.lora): the adapter id its engine request runs with


def with_lora(params: dict[str, Any], lora: str | None) -> dict[str, Any]:
    """The job's stored params (core/protocol/job_params.py), naming its adapter (unchanged for the base
    model)."""
    return params if lora is None else JobParams.written({**params, LORA_PARAM: lora})


def job_model_id(lane: str, params: dict[str, Any] | None) -> str:
    """The model a job was asked of: its adapter's id, else its lane's model."""
    lora = (params or {}).get(LORA_PARAM)
    return lora if isinstance(lora, str) else model_of(lane)
