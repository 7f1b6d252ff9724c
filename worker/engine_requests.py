"""What an attempt hands the engine: one request per choice of a generation job (n choices of each prompt,
each choice with its own sampling: worker/choices.py) or per input of an embedding job (each input with the
job's pooling). Kept on the attempt, so that a retry after a transient engine error submits the same
requests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conveyor.core.protocol.job_params import JobParams
from conveyor.engine.pooling_params import PoolingParams
from conveyor.engine.sampling_params import SamplingParams
from conveyor.worker.choices import choice_params

EngineParams = SamplingParams | PoolingParams


@dataclass(frozen=True)
class EngineRequests:
    """Request i is prompts[i] with params[i]; the attempt's request ids name them in the same order."""

    prompts: list[str | list[int]]
    params: list[EngineParams]

    def __post_init__(self) -> None:
        assert self.prompts and len(self.prompts) == len(self.params), (len(self.prompts), len(self.params))

    def __len__(self) -> int:
        return len(self.prompts)


def generation_requests(prompts: list[str | list[int]], params: SamplingParams, n: int) -> EngineRequests:
    """The job's `n` choices of each prompt, choice c of prompt p as request p * n + c: its `index` in the
    answer (core/protocol/completion_prompts.py). Token ids go to the engine as they are (nothing added)."""
    pairs = [(prompt, choice_params(params, choice)) for prompt in prompts for choice in range(n)]
    return EngineRequests([prompt for prompt, _ in pairs], [sampling for _, sampling in pairs])


def embedding_requests(inputs: list[str | list[int]], params: PoolingParams) -> EngineRequests:
    """A vector per input."""
    return EngineRequests(list(inputs), [params] * len(inputs))


def pooling_params_from_json(stored: dict[str, Any]) -> PoolingParams:
    """An embedding job's stored params (core/protocol/job_params.py, as core/protocol/embedding_request.py
    job_params writes them) -> the engine's PoolingParams; ValueError naming the field for a value the
    engine refuses. The model's own normalisation applies."""
    return pooling_params(JobParams.from_stored(stored))


def pooling_params(params: JobParams) -> PoolingParams:
    """`pooling_params_from_json` of params already read (an attempt reads its job's once)."""
    return PoolingParams(dimensions=params.dimensions, truncate=params.truncate)
