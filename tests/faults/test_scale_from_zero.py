"""Scale from zero and back, as KEDA drives it: the API takes jobs with no worker alive, /v1/scaling says how
many wait, a worker started then (the autoscaler's move) runs each exactly once, and a worker scaled down
while busy (SIGTERM, short grace) hands its jobs back, counted as load until a new worker finishes them.

Real `conveyor api` and `conveyor worker` processes on the suite's own PostgreSQL and Redis
(tests/support/fault_stack.py).
"""

from __future__ import annotations

import signal
from typing import Any

import httpx
import pytest

from tests.support.fault_stack import Stack
from tests.support.fault_store import SETTLE_S
from tests.support.faults import check_exactly_once, wait_generating
from tests.support.traffic import Traffic, long_job, short_job

pytestmark = pytest.mark.faults

QUEUES = ("interactive", "documents")
PER_QUEUE = 20
GRACE = {"WORKER_SHUTDOWN_GRACE_S": "1"}  # a scale-down that cannot wait for long jobs
LONG_TOKENS = 1200  # still generating when SIGTERM comes, on a quiet machine too


def scaling(stack: Stack) -> dict[str, dict[str, int]]:
    response = httpx.get(f"{stack.api_url}/v1/scaling", timeout=10)
    assert response.status_code == 200, response.text
    queues: dict[str, dict[str, int]] = response.json()["queues"]
    return queues


def figures(stack: Stack, *names: str) -> dict[str, tuple[int, ...]]:
    """(queued, running, load, workers) per queue."""
    keys = ("queued", "running", "load", "workers")
    return {q: tuple(v[k] for k in keys) for q, v in scaling(stack).items() if not names or q in names}


def submit_all(traffic: Traffic, bodies: list[dict[str, Any]]) -> list[str]:
    subs = [traffic.submit(body) for body in bodies]
    assert [s.accepted_code for s in subs] == [202] * len(subs), [s.codes for s in subs]
    return [s.job_id for s in subs if s.job_id is not None]


def test_jobs_wait_for_a_worker_then_run_once_and_survive_a_busy_scale_down(stack: Stack) -> None:
    traffic = stack.traffic()  # used for its keyed, retried submissions only: no steady rate
    ready = httpx.get(f"{stack.api_url}/readyz", timeout=10)
    assert ready.status_code == 200 and ready.json()["ready"] is True, ready.text  # no worker alive

    submit_all(traffic, [short_job(f"{q} {i}", 4, queue=q) for q in QUEUES for i in range(PER_QUEUE)])
    assert figures(stack) == {q: (PER_QUEUE, 0, PER_QUEUE, 0) for q in QUEUES}

    first = stack.start_worker(**GRACE)  # what KEDA does when load > 0
    check_exactly_once(stack.store, traffic.accepted(), within_s=SETTLE_S, max_attempts=1, stack=stack)
    assert figures(stack) == {q: (0, 0, 0, 1) for q in QUEUES}

    longs = submit_all(traffic, [long_job(f"long {i}", LONG_TOKENS, queue="documents") for i in range(2)])
    wait_generating(stack.store, longs)
    assert figures(stack, "documents")["documents"][1:3] == (2, 2)  # busy: running jobs are load
    first.signal(signal.SIGTERM)  # the scale-down, with a grace too short for the long jobs
    assert first.wait_exit(60) == 0
    # Handed back: queued again, still load, and no live worker: the autoscaler must start one.
    assert figures(stack, "documents") == {"documents": (2, 0, 2, 0)}

    second = stack.start_worker(**GRACE)
    outcome = check_exactly_once(stack.store, traffic.accepted(), within_s=SETTLE_S, max_attempts=2,
                                 stack=stack)
    for job_id in longs:
        job = outcome.jobs[job_id]
        assert (job.attempts, job.worker_id, job.completion_tokens) == (2, second.worker_id, LONG_TOKENS), (
            f"{job_id}: should be handed back at shutdown and run once, whole, on the second worker")
    assert figures(stack) == {q: (0, 0, 0, 1) for q in QUEUES}
