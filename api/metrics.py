"""Prometheus metrics, one registry per app instance.

Counters the API itself sees (submissions, rejections, HTTP responses) live in this process: sum() them over
API replicas. Job outcomes happen in workers, so they are read from the store at scrape time: every API
replica reports the same cluster-wide numbers, counted by one rule whatever the deployment, so dashboards
take max() over replicas (never sum()). The job latency histograms and outcome counters come from the
`metric_counts` table (core/store/outcome_counts.py), written once per job in its final transition.
Embedded, the engine's own metrics (worker/engine_metrics.py) join this registry (`extra`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.clock import utcnow
from conveyor.core.lanes import split_lane
from conveyor.core.metric_buckets import LATENCY_BUCKETS_S
from conveyor.core.settings import Settings
from conveyor.core.store import job_tallies, outcome_counts, workers
from conveyor.core.store.tables import MetricCount

log = logging.getLogger(__name__)
LANE_LABELS = ["model", "queue"]  # every per-queue series is per model too (core/lanes.py)


class Metrics:
    def __init__(self, settings: Settings, session_factory: sessionmaker[Session],
                 extra: Collector | None = None) -> None:
        self.registry = CollectorRegistry()
        self.jobs_submitted = Counter(
            "conveyor_jobs_submitted", "Jobs accepted by this API process", ["model", "queue"],
            registry=self.registry,
        )
        self.jobs_rejected = Counter(
            "conveyor_jobs_rejected", "Submissions refused, by error code", ["model", "queue", "code"],
            registry=self.registry,
        )
        self.http_responses = Counter(
            "conveyor_http_responses", "HTTP responses by route template and status code",
            ["method", "route", "status"], registry=self.registry,
        )
        self.registry.register(StoreCollector(settings, session_factory))
        if extra is not None:
            self.registry.register(extra)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StoreCollector(Collector):
    """Queue depth, running jobs, oldest queued age, load and live workers, finished jobs and preemptions,
    read from the store."""

    def __init__(self, settings: Settings, session_factory: sessionmaker[Session]) -> None:
        self._settings = settings
        self._session_factory = session_factory

    def collect(self) -> Iterator[Metric]:
        try:
            with self._session_factory() as session:
                counts = job_tallies.queue_counts(session, utcnow(), may_fold=True)
                outcomes = outcome_counts.all_counts(session)
                consumers = workers.live_workers_per_queue(
                    session, now=utcnow(), dead_after_s=self._settings.worker_dead_after_s)
        except Exception as exc:  # a scrape must not fail because the database is briefly down
            log.warning("metrics: store unavailable: %s", exc)
            return
        yield from self._queue_gauges(counts, consumers)
        yield self._scheduled_gauge({lane: c.scheduled for lane, c in counts.items()})
        yield from _finished_counters(outcome_counts.series_of(outcomes, outcome_counts.JOBS_FINISHED))
        yield from outcome_families(outcomes)

    def _queue_gauges(self, counts: dict[str, job_tallies.QueueCounts],
                      consumers: dict[str, int]) -> Iterator[Metric]:
        now = utcnow()
        depth = GaugeMetricFamily("conveyor_queue_depth", "Queued jobs", labels=LANE_LABELS)
        running = GaugeMetricFamily("conveyor_queue_running", "Running jobs", labels=LANE_LABELS)
        oldest = GaugeMetricFamily("conveyor_queue_oldest_age_seconds", "Age of the oldest queued job",
                                   labels=LANE_LABELS)
        lanes = sorted(set(self._settings.lanes()) | set(counts))
        for lane in lanes:
            c = counts.get(lane, job_tallies.QueueCounts(0, 0, None))
            depth.add_metric(lane_labels(lane), c.queued)
            running.add_metric(lane_labels(lane), c.running)
            age = (now - c.oldest_queued_at).total_seconds() if c.oldest_queued_at else 0.0
            oldest.add_metric(lane_labels(lane), age)
        yield from (depth, running, oldest, self._ttl_gauge())
        yield from _scaling_gauges(lanes, counts, consumers)

    def _scheduled_gauge(self, scheduled: dict[str, int]) -> Metric:
        """Scheduled jobs not due yet: apart from the depth (and the scaling signal) until they are."""
        gauge = GaugeMetricFamily("conveyor_queue_scheduled", "Scheduled jobs not due yet",
                                  labels=LANE_LABELS)
        for lane in sorted(set(self._settings.lanes()) | set(scheduled)):
            gauge.add_metric(lane_labels(lane), scheduled.get(lane, 0))
        return gauge

    def _ttl_gauge(self) -> Metric:
        """Each queue's default ttl, so an alert can compare the oldest queued job's age with it."""
        ttl = GaugeMetricFamily("conveyor_queue_default_ttl_seconds",
                                "The queue's default ttl (default_ttl_s): queued jobs expire past it",
                                labels=LANE_LABELS)
        for model_id, model_settings in self._settings.served().items():
            for name, queue in model_settings.queues.items():
                if queue.default_ttl_s is not None:
                    ttl.add_metric([model_id, name], queue.default_ttl_s)
        return ttl


def _scaling_gauges(lanes: list[str], counts: dict[str, job_tallies.QueueCounts],
                    consumers: dict[str, int]) -> Iterator[Metric]:
    """The figures of /v1/scaling, for an autoscaler that reads Prometheus, and for dashboards."""
    load = GaugeMetricFamily("conveyor_queue_load", "Queued plus running jobs: what workers scale on",
                             labels=LANE_LABELS)
    live = GaugeMetricFamily("conveyor_queue_workers", "Live workers consuming the queue", labels=LANE_LABELS)
    for lane in lanes:
        c = counts.get(lane, job_tallies.QueueCounts(0, 0, None))
        load.add_metric(lane_labels(lane), c.queued + c.running)
        live.add_metric(lane_labels(lane), consumers.get(lane, 0))
    yield from (load, live)


def lane_labels(lane: str) -> list[str]:
    """The `model` and `queue` labels of a lane (core/lanes.py)."""
    return list(split_lane(lane))


HISTOGRAM_HELP = {
    outcome_counts.QUEUE_TIME: "Job created to started (or to final, if it never started), per final status",
    outcome_counts.TTFT: "Job created to its first token, per final status (jobs that had one)",
    outcome_counts.E2E: "Job created to final, per final status",
    outcome_counts.LATENESS: "How far past its deadline a job ended, per final status (jobs that missed it)",
}


def outcome_families(rows: list[MetricCount]) -> Iterator[Metric]:
    """The job histograms and outcome counters of the metric_counts table, as Prometheus families."""
    for metric, doc in HISTOGRAM_HELP.items():
        yield _histogram_family(f"conveyor_{metric}", doc, outcome_counts.series_of(rows, metric))
    outcomes = CounterMetricFamily("conveyor_job_outcomes", "Jobs that reached a final status (from the "
                                   "end-to-end histogram's counts)", labels=[*LANE_LABELS, "status"])
    per_status: dict[tuple[str, str], int] = {}
    for row in outcome_counts.series_of(rows, outcome_counts.E2E):
        per_status[(row.queue, row.status)] = per_status.get((row.queue, row.status), 0) + row.count
    for (lane, status), n in sorted(per_status.items()):
        outcomes.add_metric([*lane_labels(lane), status], n)
    yield outcomes
    failures = outcome_counts.series_of(rows, outcome_counts.JOB_FAILURES)
    lines = outcome_counts.series_of(rows, outcome_counts.BATCH_LINES)
    deliveries = outcome_counts.series_of(rows, outcome_counts.WEBHOOK_DELIVERIES)
    yield _counter_family("conveyor_job_failures", "Failed and expired jobs by error code",
                          [*LANE_LABELS, "code"],
                          [((*lane_labels(r.queue), r.label), r.count) for r in failures])
    yield _counter_family("conveyor_job_deadlines", "Jobs with a deadline by service tier and outcome: "
                          "on_time (succeeded by it), late (succeeded after it), missed (ended otherwise)",
                          [*LANE_LABELS, "tier", "outcome"], _deadline_values(rows))
    yield _counter_family("conveyor_batch_lines", "Batch lines whose job finished, by outcome",
                          [*LANE_LABELS, "outcome"],
                          [((*lane_labels(r.queue), r.label), r.count) for r in lines])
    yield _counter_family("conveyor_webhook_deliveries", "Webhook delivery attempts by outcome", ["outcome"],
                          [((r.label,), r.count) for r in deliveries])


def _finished_counters(rows: list[MetricCount]) -> Iterator[Metric]:
    """Jobs per final status and their preemptions, as counted when each became final (never a count of the
    jobs table, which grows with the history kept)."""
    finished = CounterMetricFamily("conveyor_jobs_finished", "Jobs that reached a final status",
                                   labels=[*LANE_LABELS, "status"])
    preempted = CounterMetricFamily("conveyor_job_preemptions",
                                    "Engine preemptions of jobs, counted when the job ends",
                                    labels=LANE_LABELS)
    preemptions: dict[str, float] = {}
    for row in rows:
        finished.add_metric([*lane_labels(row.queue), row.status], row.count)
        preemptions[row.queue] = preemptions.get(row.queue, 0.0) + row.total
    for lane, total in sorted(preemptions.items()):
        preempted.add_metric(lane_labels(lane), total)
    yield finished
    yield preempted


def _deadline_values(rows: list[MetricCount]) -> list[tuple[tuple[str, ...], int]]:
    """(model, queue, tier, outcome) -> jobs. Rows from before tiers were counted read as the default tier,
    and are added to its row: each label set is one series."""
    values: dict[tuple[str, ...], int] = {}
    for row in outcome_counts.series_of(rows, outcome_counts.JOB_DEADLINES):
        key = (*lane_labels(row.queue), outcome_counts.row_tier(row.status), row.label)
        values[key] = values.get(key, 0) + row.count
    return list(values.items())


def _counter_family(name: str, doc: str, labels: list[str],
                    values: list[tuple[tuple[str, ...], int]]) -> Metric:
    family = CounterMetricFamily(name, doc, labels=labels)
    for label_values, n in sorted(values):
        family.add_metric(list(label_values), n)
    return family


def _histogram_family(name: str, doc: str, rows: list[MetricCount]) -> Metric:
    """Cumulative buckets per (model, queue, status) from the table's per-bucket rows."""
    bounds = [repr(b) for b in LATENCY_BUCKETS_S] + [outcome_counts.INF_LABEL]
    series: dict[tuple[str, str], tuple[list[int], list[float]]] = {}
    for row in rows:
        counts, total = series.setdefault((row.queue, row.status), ([0] * len(bounds), [0.0]))
        counts[bounds.index(row.label)] += row.count
        total[0] += row.total
    family = HistogramMetricFamily(name, doc, labels=[*LANE_LABELS, "status"])
    for (lane, status), (counts, total) in sorted(series.items()):
        cumulative = [sum(counts[: i + 1]) for i in range(len(counts))]
        family.add_metric([*lane_labels(lane), status], list(zip(bounds, cumulative, strict=True)),
                          sum_value=total[0])
    return family
