"""Speculative decoding reaches Prometheus: `conveyor:spec_decode_num_draft_tokens_total` and
`..._accepted_tokens_total` per method and queue, read from the engine's stats at scrape time (so acceptance
per method and queue is the ratio of their rates); an engine that does not speculate exports both families
with no series."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus_client import generate_latest

from conveyor.engine.config import EngineConfig, RequestClassConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.sampling_params import SamplingParams
from conveyor.worker.engine_metrics import WorkerMetrics
from tests.support.engine import drain
from tests.support.metrics import Families, StatsHost, parse, value

CLASSES = [RequestClassConfig("interactive", max_running=4, priority=0),
           RequestClassConfig("documents", max_running=4, priority=1)]
REPEATED = [5, 6, 7, 8] * 8  # n-grams the request's own history repeats: the ngram method drafts from them
NAMES = ("conveyor:spec_decode_num_draft_tokens", "conveyor:spec_decode_num_accepted_tokens")


def scrape(engine: LLMEngine) -> Families:
    metrics = WorkerMetrics()
    metrics.attach(StatsHost(engine))  # type: ignore[arg-type]
    return parse(generate_latest(metrics.registry).decode())


def engine_of(model: Path, speculative: dict[str, Any] | None) -> LLMEngine:
    config = EngineConfig(model=str(model), num_kv_blocks=32, max_model_len=256, request_classes=CLASSES,
                          speculative=speculative)
    return LLMEngine(config)


def test_drafted_and_accepted_tokens_are_counted_per_method_and_queue(llama_dir: Path) -> None:
    engine = engine_of(llama_dir, {"method": "ngram", "min_ngram": 1, "dynamic": False})
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    engine.add_request("chat", REPEATED, greedy, "interactive")
    engine.add_request("doc", REPEATED[::-1], greedy, "documents")
    engine.add_request("no-drafts", REPEATED, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                             speculate=False), "documents")
    outputs = drain(engine)
    families = scrape(engine)
    per_class = engine.stats()["speculation"]["per_class"]  # type: ignore[index]
    for queue in ("interactive", "documents"):
        drafted, accepted = (value(families, f"{name}_total", method="ngram", queue=queue) for name in NAMES)
        counted = per_class[queue]
        assert (drafted, accepted) == (counted["drafted_tokens"], counted["accepted_tokens"])
        assert drafted > 0 and 0 <= accepted <= drafted, queue
    documents = value(families, "conveyor:spec_decode_num_draft_tokens_total", queue="documents")
    assert documents == outputs["doc"].num_draft_tokens, "the request that opted out drafted nothing"
    assert outputs["no-drafts"].num_draft_tokens == 0


def test_an_engine_that_does_not_speculate_exports_the_families_with_no_series(llama_dir: Path) -> None:
    families = scrape(engine_of(llama_dir, None))
    for name in NAMES:
        assert families[name].type == "counter" and families[name].samples == []
