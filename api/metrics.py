"""Prometheus metrics, one registry per app instance.

Counters the API itself sees (submissions, rejections, HTTP responses) live in this process. Job outcomes
happen in workers, so they are read from the store at scrape time: every API replica reports the same
cluster-wide numbers, counted by one rule whatever the deployment.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session, sessionmaker

from core.clock import utcnow
from core.lifecycle import TERMINAL_STATUSES
from core.settings import Settings
from core.store import jobs, workers

log = logging.getLogger(__name__)


class Metrics:
    def __init__(self, settings: Settings, session_factory: sessionmaker[Session]) -> None:
        self.registry = CollectorRegistry()
        self.jobs_submitted = Counter(
            "conveyor_jobs_submitted", "Jobs accepted by this API process", ["queue"], registry=self.registry
        )
        self.jobs_rejected = Counter(
            "conveyor_jobs_rejected", "Submissions refused, by error code", ["queue", "code"],
            registry=self.registry,
        )
        self.http_responses = Counter(
            "conveyor_http_responses", "HTTP responses by route template and status code",
            ["method", "route", "status"], registry=self.registry,
        )
        self.registry.register(StoreCollector(settings, session_factory))

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
                counts = jobs.queue_counts(session)
                totals = jobs.status_totals(session)
                consumers = workers.live_workers_per_queue(
                    session, now=utcnow(), dead_after_s=self._settings.worker_dead_after_s)
        except Exception as exc:  # a scrape must not fail because the database is briefly down
            log.warning("metrics: store unavailable: %s", exc)
            return
        yield from self._queue_gauges(counts, consumers)
        yield from self._finished_counters(totals)

    def _finished_counters(self, totals: list[tuple[str, str, int, int]]) -> Iterator[Metric]:
        finished = CounterMetricFamily("conveyor_jobs_finished", "Jobs in a final status",
                                       labels=["queue", "status"])
        preempted = CounterMetricFamily("conveyor_job_preemptions", "Engine preemptions of jobs",
                                        labels=["queue"])
        preemptions_by_queue: dict[str, int] = {}
        for queue, status, n, preemptions in totals:
            if status in TERMINAL_STATUSES:
                finished.add_metric([queue, status], n)
            preemptions_by_queue[queue] = preemptions_by_queue.get(queue, 0) + preemptions
        for queue, total in preemptions_by_queue.items():
            preempted.add_metric([queue], total)
        yield finished
        yield preempted

    def _queue_gauges(self, counts: dict[str, jobs.QueueCounts],
                      consumers: dict[str, int]) -> Iterator[Metric]:
        now = utcnow()
        depth = GaugeMetricFamily("conveyor_queue_depth", "Queued jobs", labels=["queue"])
        running = GaugeMetricFamily("conveyor_queue_running", "Running jobs", labels=["queue"])
        oldest = GaugeMetricFamily("conveyor_queue_oldest_age_seconds", "Age of the oldest queued job",
                                   labels=["queue"])
        names = sorted(set(self._settings.queues) | set(counts))
        for name in names:
            c = counts.get(name, jobs.QueueCounts(0, 0, None))
            depth.add_metric([name], c.queued)
            running.add_metric([name], c.running)
            age = (now - c.oldest_queued_at).total_seconds() if c.oldest_queued_at else 0.0
            oldest.add_metric([name], age)
        yield from (depth, running, oldest)
        yield from _scaling_gauges(names, counts, consumers)


def _scaling_gauges(names: list[str], counts: dict[str, jobs.QueueCounts],
                    consumers: dict[str, int]) -> Iterator[Metric]:
    """The figures of /v1/scaling, for an autoscaler that reads Prometheus, and for dashboards."""
    load = GaugeMetricFamily("conveyor_queue_load", "Queued plus running jobs: what workers scale on",
                             labels=["queue"])
    live = GaugeMetricFamily("conveyor_queue_workers", "Live workers consuming the queue", labels=["queue"])
    for name in names:
        c = counts.get(name, jobs.QueueCounts(0, 0, None))
        load.add_metric([name], c.queued + c.running)
        live.add_metric([name], consumers.get(name, 0))
    yield from (load, live)
