"""The worker's metrics server: off unless worker_metrics_port is set; the names keep their `conveyor:` colon
whatever format Prometheus asks for (prometheus_client's OpenMetrics output would write `conveyor_...`)."""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry, Gauge

from conveyor.core.settings import Settings
from conveyor.worker.metrics_server import serve_metrics
from tests.support.live_server import free_port

# What Prometheus 2.x sends: OpenMetrics preferred.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


def test_serves_names_with_their_colon_to_prometheus(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    Gauge("conveyor:kv_cache_usage_perc", "share in use", registry=registry).set(0.25)
    port = free_port()
    stop = serve_metrics(Settings(data_dir=tmp_path, worker_metrics_port=port), registry)
    try:
        response = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Accept": PROMETHEUS_ACCEPT})
        missing = httpx.get(f"http://127.0.0.1:{port}/other")
    finally:
        stop()
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert "\nconveyor:kv_cache_usage_perc 0.25\n" in response.text
    assert missing.status_code == 404


def test_off_without_a_port(tmp_path: Path) -> None:
    stop = serve_metrics(Settings(data_dir=tmp_path), CollectorRegistry())
    stop()  # a no-op: nothing was started
    assert Settings(data_dir=tmp_path).worker_metrics_port is None
