"""A job's stored params (JSON, engine names) -> the engine's SamplingParams, `structured` included."""

from __future__ import annotations

from typing import Any

from conveyor.core.model_adapters import LORA_PARAM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.structured_output.constraint import StructuredOutput


def sampling_params_from_json(params: dict[str, Any]) -> SamplingParams:
    """ValueError naming the field for anything the engine would refuse (unknown names included)."""
    fields = dict(params)
    fields.pop("n", None)  # the job's choices: each is a request of its own (worker/choices.py)
    fields.pop(LORA_PARAM, None)  # its adapter: the engine request's, not a sampling parameter
    structured = fields.pop("structured", None)
    try:
        if structured is not None:
            if not isinstance(structured, dict):
                raise ValueError(f"structured must be an object, got {type(structured).__name__}")
            fields["structured"] = StructuredOutput(**structured)
        return SamplingParams(**fields)
    except TypeError as exc:
        raise ValueError(f"params: {exc}") from exc
