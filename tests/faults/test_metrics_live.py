"""Metrics of a real deployment: `conveyor api` and a `conveyor worker` (its metrics port on) on PostgreSQL
and Redis. Jobs go through both queues, one is cancelled while it runs, and the worker's KV cache (8 blocks)
is too small for two documents at once, so it preempts. Then every documented metric must be on the
endpoint that owns it, with its type and labels, and the figures must add up: outcomes per status sum to the
finished jobs, each job histogram counted every job once, the engine saw every started job end once.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.fault_stack import Stack
from tests.support.live_server import free_port
from tests.support.metrics import (
    KV,
    Families,
    check_api_counts,
    check_documented,
    check_engine_counts,
    engine_settled,
    parse,
    run_scenario,
    value,
    wait_for,
)

pytestmark = pytest.mark.faults


def scrape(url: str) -> Families:
    response = httpx.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200, response.text
    return parse(response.text)


def test_worker_and_api_metrics_are_documented_and_add_up(stack: Stack) -> None:
    port = free_port()
    settings: dict[str, Any] = {k.upper(): str(v) for k, v in KV.items()}
    stack.start_worker(WORKER_METRICS_PORT=str(port), CANCEL_POLL_S="0.05", **settings)
    worker_url = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=stack.api_url, timeout=10) as client:
        scenario = run_scenario(client)
    wait_for(lambda: engine_settled(scrape(worker_url), scenario), "the engine to see every job end")

    worker, api = scrape(worker_url), scrape(stack.api_url)
    check_documented(worker, where={"worker"})
    check_documented(api, where={"api"})
    assert not any(name.startswith("conveyor:") for name in api), "engine metrics belong to the worker"
    check_engine_counts(worker, scenario)
    check_api_counts(api, scenario)
    # The stack subscribes its webhook receiver to every job event: one delivery per finished job, and the
    # receiver takes each at the first attempt.
    finished = sum(scenario.finished(q) for q in scenario.statuses)
    wait_for(
        lambda: value(scrape(stack.api_url), "conveyor_webhook_deliveries_total") >= finished,
        "every job's webhook to be delivered",
    )
    api = scrape(stack.api_url)
    assert value(api, "conveyor_webhook_deliveries_total", outcome="delivered") == finished
    assert value(api, "conveyor_webhook_deliveries_total") == finished
