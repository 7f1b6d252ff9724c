"""Conveyor's inference engine: continuous batching over a paged KV cache.

    from conveyor.engine import LLM, SamplingParams
    outputs = LLM("path/to/model").generate(["Hello"], SamplingParams(max_tokens=8))
    vectors = [out.embedding for out in LLM("path/to/embedding-model").embed(["Hello"], PoolingParams())]

Heavy modules (torch, transformers) load on first use of the names that need them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from conveyor.engine.config import EngineConfig, RequestClassConfig
from conveyor.engine.outputs import RequestMetrics, RequestOutput
from conveyor.engine.pooling_params import PoolingParams
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.structured_output.constraint import StructuredOutput

if TYPE_CHECKING:
    from conveyor.engine.host import EngineHost
    from conveyor.engine.llm import LLM
    from conveyor.engine.llm_engine import LLMEngine

_LAZY = {"LLM": "conveyor.engine.llm", "LLMEngine": "conveyor.engine.llm_engine",
         "EngineHost": "conveyor.engine.host"}

__all__ = [
    "LLM",
    "EngineConfig",
    "EngineHost",
    "LLMEngine",
    "PoolingParams",
    "RequestClassConfig",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutput",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
