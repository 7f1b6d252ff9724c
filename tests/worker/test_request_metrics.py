"""The per-request engine metrics carry the LoRA adapter a request ran with (`lora`, "" for the base
model), beside its queue."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from conveyor.engine.outputs import RequestMetrics as Timings
from conveyor.engine.outputs import RequestOutput
from conveyor.worker.engine_metrics import RequestMetrics


def finished(lora: str | None, tokens: int) -> RequestOutput:
    timings = Timings(arrival_time=1.0, first_scheduled_time=1.5, first_token_time=2.0, finished_time=3.0)
    return RequestOutput("r", [1, 2, 3], list(range(tokens)), "", "length", timings, lora=lora)


def test_each_request_is_counted_under_its_queue_and_adapter() -> None:
    registry = CollectorRegistry()
    metrics = RequestMetrics(registry)
    metrics.observe("interactive", finished("support", 4))
    metrics.observe("interactive", finished(None, 2))
    metrics.observe("documents", finished("support", 3))

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value("conveyor:" + name, labels)

    assert sample("generation_tokens_total", queue="interactive", lora="support") == 4
    assert sample("generation_tokens_total", queue="interactive", lora="") == 2
    assert sample("generation_tokens_total", queue="documents", lora="support") == 3
    assert sample("request_success_total", queue="interactive", lora="support", finished_reason="length") == 1
    assert sample("e2e_request_latency_seconds_count", queue="documents", lora="support") == 1
    assert sample("request_queue_time_seconds_sum", queue="interactive", lora="") == 0.5
