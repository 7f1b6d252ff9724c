"""A mixture of experts' load balance reaches Prometheus: `conveyor:expert_tokens_total{expert}`, read from
the engine's stats at scrape time; a dense model exports the family with no series."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest

from conveyor.engine.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.worker.engine_metrics import WorkerMetrics
from tests.support.engine import run_staggered
from tests.support.metrics import StatsHost, parse, value


def scrape(engine: LLMEngine) -> dict[str, Any]:
    metrics = WorkerMetrics()
    metrics.attach(StatsHost(engine))  # type: ignore[arg-type]
    return parse(generate_latest(metrics.registry).decode())


def test_tokens_per_expert_are_counted(tiny_model_dir: Callable[..., Path]) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("MixtralForCausalLM")), num_kv_blocks=32,
                                    max_model_len=256))
    run_staggered(engine, [("a", list(range(3, 40)), 5), ("b", list(range(50, 60)), 7)], first=2, then=0)
    families = scrape(engine)
    per_expert = [value(families, "conveyor:expert_tokens_total", expert=str(e)) for e in range(4)]
    totals = engine.stats()["totals"]
    assert isinstance(totals, dict)
    assert per_expert == totals["expert_tokens"] and sum(per_expert) == (37 + 10 + 4 + 6) * 2 * 2


def test_a_dense_model_exports_no_expert_series(llama_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=32, max_model_len=256))
    family = scrape(engine)["conveyor:expert_tokens"]
    assert family.type == "counter" and family.samples == []
