"""Scheduled jobs across a worker's death, on the suite's own PostgreSQL and Redis: one job due per second
for 30 s, the only worker SIGKILLed a few seconds in and a new one started after more jobs fell due. Every job
starts in due order, none before its time, none is lost and none runs twice (the embedded run of the same
check: tests/worker/test_scheduled_serve.py)."""

from __future__ import annotations

import signal
import time

import pytest

from conveyor.core.clock import utcnow
from tests.support.fault_stack import Stack
from tests.support.fault_store import SETTLE_S
from tests.support.faults import check_exactly_once, running_on
from tests.support.scheduled_jobs import check_due_order, submit_one_per_second

pytestmark = pytest.mark.faults


def test_scheduled_jobs_start_in_due_order_across_a_worker_kill(stack: Stack) -> None:
    first = stack.start_worker(SCHEDULE_POLL_S="0.2")
    accepted, first_due = submit_one_per_second(stack.api_url, "sched")
    time.sleep(max(0.0, (first_due - utcnow()).total_seconds()) + 6.5)  # some jobs have run

    first.signal(signal.SIGKILL)
    first.wait_exit(30)
    in_flight = running_on(stack.store, first.worker_id)
    time.sleep(4.0)  # more jobs fall due while no worker runs: they wait, scheduled
    second = stack.start_worker(SCHEDULE_POLL_S="0.2")

    outcome = check_exactly_once(stack.store, accepted, within_s=SETTLE_S + 40, max_attempts=2, stack=stack,
                                 reruns_allowed=in_flight)
    check_due_order(outcome.jobs, accepted, in_flight)
    ran_on = {job.worker_id for job in outcome.jobs.values()}
    assert ran_on == {first.worker_id, second.worker_id}, "both workers should have run some of them"
