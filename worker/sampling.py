"""A job's stored params -> the engine's SamplingParams: the worker's one mapping of JobParams' sampling
fields (core/protocol/job_params.py) onto the engine's, `structured` included. tests/core/test_job_params.py
holds both to the same fields, each mapped."""

from __future__ import annotations

from typing import Any

from conveyor.core.protocol.job_params import SAMPLING_FIELDS, JobParams, StoredStructured
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.structured_output.constraint import StructuredOutput


def sampling_params_from_json(stored: dict[str, Any]) -> SamplingParams:
    """ValueError naming the field for anything the engine would refuse, or a value no writer stores. Keys
    this release does not know are ignored (JobParams.from_stored); `n` and the adapter are not sampling."""
    return sampling_params(JobParams.from_stored(stored))


def sampling_params(params: JobParams) -> SamplingParams:
    """`sampling_params_from_json` of params already read (an attempt reads its job's once)."""
    fields = {name: getattr(params, name) for name in SAMPLING_FIELDS - {"structured"}}
    return SamplingParams(**fields, structured=_structured_output(params.structured))


def _structured_output(structured: StoredStructured | None) -> StructuredOutput | None:
    return None if structured is None else StructuredOutput(**structured.model_dump())
