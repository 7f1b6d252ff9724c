"""The metrics reference: every family a worker's and an API's registries export."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from conveyor.api.metrics import Metrics
from conveyor.cli.reference.markdown import cell
from conveyor.core.settings import Settings, default_queues
from conveyor.core.store.database import make_db_engine, make_session_factory
from conveyor.core.store.migrate import upgrade
from conveyor.engine.host import EngineHost
from conveyor.engine.stats import EngineTotals, StepStats, stats_dict
from conveyor.worker.cold_start import ColdStart
from conveyor.worker.engine_metrics import WorkerMetrics


@dataclass(frozen=True)
class ExportedMetric:
    name: str  # the family name (a counter's without `_total`)
    type: str  # counter | gauge | histogram
    help: str
    where: str  # "worker" (a worker's /metrics, the embedded server's too) or "api"


class _IdleEngine:
    """What WorkerMetrics reads of an EngineHost, for an idle engine: every family it exports appears."""

    def on_request_finished(self, listener: Callable[..., None]) -> None:
        pass

    def on_step_end(self, listener: Callable[[], None]) -> None:
        pass

    def stats(self) -> dict[str, object]:
        queues = {name: 0 for name in default_queues()}
        idle = stats_dict(running=queues, waiting=queues, kv_blocks_used=0, kv_blocks_total=1, block_size=16,
                          preemptions_total=0, last_step=StepStats(), totals=EngineTotals(),
                          prefix_cache_blocks=0)
        return {**idle, "speculation": None}  # LLMEngine.stats() adds it: None when not speculating


def exported_metrics() -> list[ExportedMetric]:
    """Every family a worker and an API export, collected once from their registries (the API's on an empty,
    migrated SQLite store)."""
    worker = WorkerMetrics()
    worker.attach(cast(EngineHost, _IdleEngine()), heartbeat_age_s=lambda: 0.0)
    worker.track_cold_start(ColdStart())
    found = [ExportedMetric(f.name, f.type, f.documentation, "worker") for f in worker.registry.collect()]
    with tempfile.TemporaryDirectory() as data_dir:
        url = f"sqlite:///{Path(data_dir) / 'conveyor.db'}"
        upgrade(url)
        db = make_db_engine(url)
        try:
            api = Metrics(Settings(data_dir=Path(data_dir), database_url=url), make_session_factory(db))
            found += [ExportedMetric(f.name, f.type, f.documentation, "api") for f in api.registry.collect()]
        finally:
            db.dispose()
    return found


def metrics_page(metrics: list[ExportedMetric]) -> str:
    lines = ["# Metrics", "",
             "Every Prometheus metric a worker and the API export, collected from their registries when this"
             " site was built. `worker`: a `conveyor worker` serves them on `CONVEYOR_WORKER_METRICS_PORT`,"
             " `conveyor serve` on its own `/metrics`; `api`: every API process's `/metrics`. Labels, how to"
             " aggregate them, the dashboard and the alerts:"
             " [Metrics, dashboards and alerts](../operations/metrics.md).", "",
             "| name | type | from | help |", "|---|---|---|---|"]
    for metric in sorted(metrics, key=lambda m: (m.where, m.name)):
        name = metric.name + ("_total" if metric.type == "counter" else "")
        lines.append(f"| `{name}` | {metric.type} | {metric.where} | {cell(metric.help)} |")
    return "\n".join(lines) + "\n"
