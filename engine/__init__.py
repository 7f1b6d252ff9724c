"""Conveyor's inference engine: continuous batching over a paged KV cache.

    from engine import LLM, SamplingParams
    outputs = LLM("path/to/model").generate(["Hello"], SamplingParams(max_tokens=8))
    vectors = [out.embedding for out in LLM("path/to/embedding-model").embed(["Hello"], PoolingParams())]

Heavy modules (torch, transformers) load on first use of the names that need them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig, RequestClassConfig
from engine.outputs import RequestMetrics, RequestOutput
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutput

if TYPE_CHECKING:
    from engine.host import EngineHost
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine

_LAZY = {"LLM": "engine.llm", "LLMEngine": "engine.llm_engine", "EngineHost": "engine.host"}

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
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
