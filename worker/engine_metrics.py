"""A worker's engine figures as Prometheus metrics: vLLM's names with a `conveyor:` prefix, `queue` per class.

The engine stays free of Prometheus: this module reads what it already computes. Three moments, none per
token:
- per finished request (EngineHost.on_request_finished, on the engine thread): the latency histograms from
  RequestOutput.metrics, token and preemption counters;
- per step (EngineHost.on_step_end): the step's duration and tokens, two histogram observations;
- per scrape (a collector): running and waiting requests, KV cache use, the prefix cache and speculative
  decoding's drafted and accepted tokens, read from the host's stats snapshot (copied once per step), and the
  cold-start figures.

One registry per WorkerMetrics (never prometheus_client's global one). A worker is one process, so no
multiprocess mode is needed: `conveyor worker` serves the registry on worker_metrics_port, and the embedded
server adds it to its own /metrics. Either way every sample carries the `model` its engine serves
(`by_model`): the embedded server runs one engine per model, and their families merge into one each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from conveyor.core.metric_buckets import LATENCY_BUCKETS_S, STEP_BUCKETS_S, STEP_TOKEN_BUCKETS
from conveyor.engine.host import EngineHost
from conveyor.engine.outputs import RequestOutput
from conveyor.worker.cold_start import ColdStart

PREFIX = "conveyor:"


class WorkerMetrics:
    """Create it before the engine exists (its registry can be handed out early); attach() the host."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._requests = RequestMetrics(self.registry)
        self._steps = StepMetrics(self.registry)
        self._snapshot = SnapshotCollector()
        self.registry.register(self._snapshot)

    def attach(self, host: EngineHost, heartbeat_age_s: Callable[[], float] | None = None) -> None:
        """Observes the host's finished requests and steps from now on; its gauges (and the heartbeat's
        age, when given) appear at the next scrape."""
        host.on_request_finished(self._requests.observe)
        host.on_step_end(lambda: self._steps.observe(host))
        self._snapshot.host = host
        self._snapshot.heartbeat_age_s = heartbeat_age_s

    def track_cold_start(self, cold_start: ColdStart) -> None:
        self._snapshot.cold_start = cold_start


def by_model(registries: dict[str, CollectorRegistry]) -> CollectorRegistry:
    """One registry of the engines' metrics, each sample labelled with its engine's model."""
    registry = CollectorRegistry()
    registry.register(ModelLabelled(registries))
    return registry


class ModelLabelled(Collector):
    """Each model's engine metrics as one family per name (a name twice would be invalid exposition), every
    sample with a `model` label."""

    def __init__(self, registries: dict[str, CollectorRegistry]) -> None:
        self._registries = registries

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for model_id, registry in self._registries.items():
            for family in registry.collect():
                into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                             family.unit))
                into.samples += [sample._replace(labels={"model": model_id, **sample.labels})
                                 for sample in family.samples]
        yield from merged.values()


REQUEST_LABELS = ("queue", "lora")  # of the per-request metrics: "" for the base model


def _histogram(
    name: str,
    doc: str,
    registry: CollectorRegistry,
    buckets: tuple[float, ...],
    labels: tuple[str, ...] = REQUEST_LABELS,
) -> Histogram:
    return Histogram(PREFIX + name, doc, list(labels), buckets=buckets, registry=registry)



class RequestMetrics:
    """Observed once per request when it finishes, so every histogram's count is its finished requests
    (the ones that reached that phase: a request aborted while waiting has no first token). Labelled by
    queue and LoRA adapter (`lora`: "" for the base model)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        lat = LATENCY_BUCKETS_S
        self.e2e = _histogram("e2e_request_latency_seconds", "Arrival in the engine to finish", registry, lat)
        self.queue_time = _histogram(
            "request_queue_time_seconds", "Arrival to first scheduled", registry, lat
        )
        self.ttft = _histogram("time_to_first_token_seconds", "Arrival to first token", registry, lat)
        self.prefill = _histogram(
            "request_prefill_time_seconds", "First scheduled to first token", registry, lat
        )
        self.decode = _histogram("request_decode_time_seconds", "First token to finish", registry, lat)
        self.itl = _histogram(
            "inter_token_latency_seconds",
            "Mean time between two output tokens of a request, observed once per request",
            registry,
            STEP_BUCKETS_S,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests", list(REQUEST_LABELS),
            registry=registry,
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens",
            "Tokens generated by finished requests",
            list(REQUEST_LABELS),
            registry=registry,
        )
        self.preemptions = Counter(
            PREFIX + "num_preemptions",
            "Preemptions of finished requests (recomputed)",
            list(REQUEST_LABELS),
            registry=registry,
        )
        self.finished = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason",
            [*REQUEST_LABELS, "finished_reason"],
            registry=registry,
        )
        self._series: dict[tuple[str, str], _RequestSeries] = {}

    def observe(self, queue: str, out: RequestOutput) -> None:
        labels = (queue, out.lora or "")
        series = self._series.get(labels) or self._series_of(labels)
        m = out.metrics
        end = m.finished_time if m.finished_time is not None else m.arrival_time
        series.e2e.observe(end - m.arrival_time)
        if m.first_scheduled_time is not None:
            series.queue_time.observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is not None:
            series.ttft.observe(m.first_token_time - m.arrival_time)
            series.decode.observe(end - m.first_token_time)
            if m.first_scheduled_time is not None:
                series.prefill.observe(m.first_token_time - m.first_scheduled_time)
            if len(out.token_ids) > 1:
                series.itl.observe((end - m.first_token_time) / (len(out.token_ids) - 1))
        series.prompt_tokens.inc(len(out.prompt_token_ids))
        series.generation_tokens.inc(len(out.token_ids))
        series.preemptions.inc(m.num_preemptions)
        self.finished.labels(*labels, out.finish_reason or "abort").inc()

    def _series_of(self, labels: tuple[str, str]) -> _RequestSeries:
        """The labelled series of one (queue, lora), looked up once: `labels()` costs more than an
        observation, and a request makes nine. Only the engine thread observes: no race to guard."""
        series = _RequestSeries(*(metric.labels(*labels) for metric in (
            self.e2e, self.queue_time, self.ttft, self.prefill, self.decode, self.itl, self.prompt_tokens,
            self.generation_tokens, self.preemptions)))
        self._series[labels] = series
        return series


@dataclass(frozen=True)
class _RequestSeries:
    """RequestMetrics' series of one (queue, lora) label pair (the finish counter has a third label)."""

    e2e: Histogram
    queue_time: Histogram
    ttft: Histogram
    prefill: Histogram
    decode: Histogram
    itl: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter
    preemptions: Counter


class StepMetrics:
    """Two observations per engine step that did work (on the engine thread)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.step_time = _histogram(
            "engine_step_duration_seconds",
            "Wall time of one engine step",
            registry,
            STEP_BUCKETS_S,
            labels=(),
        )
        self.tokens = _histogram(
            "iteration_tokens_total",
            "Tokens computed by one engine step (prefill + decode)",
            registry,
            STEP_TOKEN_BUCKETS,
            labels=(),
        )

    def observe(self, host: EngineHost) -> None:
        step = host.engine.last_step
        if step.num_seqs:
            self.step_time.observe(step.step_seconds)
            self.tokens.observe(step.prefill_tokens + step.decode_tokens)


class SnapshotCollector(Collector):
    """Gauges and engine-cumulative counters read at scrape time from the host's per-step stats copy."""

    def __init__(self) -> None:
        self.host: EngineHost | None = None
        self.cold_start: ColdStart | None = None
        self.heartbeat_age_s: Callable[[], float] | None = None

    def collect(self) -> Iterator[Metric]:
        if self.host is not None:
            yield from _engine_families(self.host.stats())
        if self.cold_start is not None:
            yield _cold_start_family(self.cold_start)
        if self.heartbeat_age_s is not None:
            yield GaugeMetricFamily(
                PREFIX + "heartbeat_age_seconds",
                "Seconds since the store last took this worker's heartbeat",
                value=self.heartbeat_age_s(),
            )


def _engine_families(stats: dict[str, Any]) -> Iterator[Metric]:
    running = GaugeMetricFamily(
        PREFIX + "num_requests_running", "Requests in the engine's running set", labels=["queue"]
    )
    waiting = GaugeMetricFamily(
        PREFIX + "num_requests_waiting", "Requests waiting in the engine", labels=["queue"]
    )
    for queue, n in sorted(stats["running"].items()):
        running.add_metric([queue], n)
    for queue, n in sorted(stats["waiting"].items()):
        waiting.add_metric([queue], n)
    yield running
    yield waiting
    yield GaugeMetricFamily(
        PREFIX + "kv_cache_usage_perc", "Share of KV cache blocks in use (0-1)", value=stats["kv_usage"]
    )
    yield GaugeMetricFamily(
        PREFIX + "kv_cache_blocks", "KV cache blocks in all", value=stats["kv_blocks_total"]
    )
    yield from _prefix_cache_families(stats["prefix_cache"])
    yield from _speculation_families(stats["speculation"])
    yield _expert_family(stats["totals"]["expert_tokens"])


def _expert_family(expert_tokens: list[int]) -> Metric:
    """Tokens routed to each expert since the engine started, over its MoE layers (a dense model: none)."""
    help_text = "Tokens routed to each expert, summed over the MoE layers"
    family = CounterMetricFamily(PREFIX + "expert_tokens", help_text, labels=["expert"])
    for expert, tokens in enumerate(expert_tokens):
        family.add_metric([str(expert)], tokens)
    return family


def _speculation_families(speculation: dict[str, Any] | None) -> Iterator[Metric]:
    """Tokens drafted and accepted since the engine started, per method and queue (the acceptance rate is the
    ratio of their rates); an engine that does not speculate exports the families with no series."""
    labels = ["method", "queue"]
    drafted = CounterMetricFamily(PREFIX + "spec_decode_num_draft_tokens",
                                  "Tokens proposed by speculative decoding", labels=labels)
    accepted = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens",
                                   "Proposed tokens the model accepted", labels=labels)
    if speculation is not None:
        for queue, counts in sorted(speculation["per_class"].items()):
            drafted.add_metric([speculation["method"], queue], counts["drafted_tokens"])
            accepted.add_metric([speculation["method"], queue], counts["accepted_tokens"])
    yield drafted
    yield accepted


def _prefix_cache_families(cache: dict[str, Any]) -> Iterator[Metric]:
    yield CounterMetricFamily(
        PREFIX + "prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache",
        value=cache["queries_total"],
    )
    yield CounterMetricFamily(
        PREFIX + "prefix_cache_hits", "Prompt tokens found in the prefix cache", value=cache["hits_total"]
    )
    rate = cache["hit_rate"]
    yield GaugeMetricFamily(
        PREFIX + "prefix_cache_hit_rate",
        "Hits / queries since the engine started (0 before any lookup)",
        value=rate if rate is not None else 0.0,
    )


def _cold_start_family(cold_start: ColdStart) -> Metric:
    family = GaugeMetricFamily(
        PREFIX + "cold_start_seconds", "Process start to this phase of the cold start", labels=["phase"]
    )
    phases = {"engine_ready": cold_start.engine_ready_s, "first_token": cold_start.first_token_s}
    for phase, seconds in phases.items():
        if seconds is not None:
            family.add_metric([phase], seconds)
    return family
