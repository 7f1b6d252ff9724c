"""`conveyor worker`'s own /metrics: its engine's registry on worker_metrics_port, bound to the settings'
host.

Loopback unless `host` says otherwise (the Kubernetes manifests set 0.0.0.0 so Prometheus reaches the pod).
It takes no credential, like vLLM's: the figures are one engine's, aggregated per queue, with no tenant,
prompt or job in them.

NOTE: always Prometheus' classic text format, whatever the scraper's Accept header asks for. Prometheus asks
for OpenMetrics first, and prometheus_client (0.26) then writes sample names with `:` turned into `_`
while their # TYPE lines keep the `:`, so Prometheus would store `conveyor_kv_cache_usage_perc` instead of
`conveyor:kv_cache_usage_perc` and every dashboard query would miss. The text format keeps the names as
registered (the API's /metrics serves the same format).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from conveyor.core.settings import Settings

log = logging.getLogger(__name__)


def serve_metrics(settings: Settings, registry: CollectorRegistry) -> Callable[[], None]:
    """Starts the server when worker_metrics_port is set; returns what stops it (a no-op when not)."""
    port = settings.worker_metrics_port
    if port is None:
        return lambda: None
    server = ThreadingHTTPServer((settings.host, port), _handler(registry))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="metrics-server", daemon=True)
    thread.start()
    log.info("engine metrics on http://%s:%d/metrics", settings.host, server.server_address[1])

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join()

    return stop


def _handler(registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    class MetricsHandler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404, "only /metrics is served here")
                return
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # a scrape every few seconds is not news
            pass

    return MetricsHandler
