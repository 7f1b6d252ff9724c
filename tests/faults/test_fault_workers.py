"""Worker faults: SIGKILL, SIGSTOP/SIGCONT, SIGTERM (short and long grace), and two workers sharing the load.

Each test runs real `conveyor worker` processes on the suite's own PostgreSQL and Redis, submits jobs over
HTTP through the shared `conveyor api`, injects the fault, and ends with the central assertion
(check_exactly_once): every accepted job reaches a final state once, for the right reason.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.support.fault_stack import DEAD_AFTER_S, Stack
from tests.support.fault_store import SETTLE_S, WAIT_S, wait_until
from tests.support.faults import check_exactly_once, describe, running_on, succeeded_on, wait_generating
from tests.support.traffic import Traffic, long_job, short_job

pytestmark = pytest.mark.faults


def _traffic(stack: Stack, rate: float, name: str, max_tokens: int = 16) -> Traffic:
    """Short jobs of exactly max_tokens tokens (EOS ignored): long enough to be in flight at a fault."""
    return stack.traffic(rate=rate, prefix=name,
                   body=lambda i: short_job(f"{name} {i}: the river is calm", max_tokens, ignore_eos=True))


def test_worker_sigkill_mid_traffic_every_job_ends_once_on_a_new_worker(stack: Stack) -> None:
    first = stack.start_worker()
    traffic = _traffic(stack, 10, "sigkill").start()
    longs = [traffic.submit(long_job(f"long {i}", 400, queue="documents")).job_id for i in range(3)]
    wait_generating(stack.store, longs)
    traffic.wait_submitted(10)  # short jobs in flight beside the long ones

    first.signal(signal.SIGKILL)
    first.wait_exit(30)
    in_flight = running_on(stack.store, first.worker_id)  # the dead worker's claimed jobs
    assert set(longs) <= in_flight
    traffic.wait_submitted(20)  # traffic keeps arriving while no worker runs
    second = stack.start_worker()
    wait_until(lambda: bool(succeeded_on(stack.store, second.worker_id)), "the new worker to finish a job",
               WAIT_S)
    traffic.stop()

    assert not traffic.unsettled(), [s.codes for s in traffic.unsettled()]
    outcome = check_exactly_once(stack.store, traffic.accepted(), within_s=SETTLE_S, max_attempts=2,
                                 stack=stack, reruns_allowed=in_flight)
    for job_id in in_flight:
        job = outcome.jobs[job_id]
        assert (job.attempts, job.worker_id) == (2, second.worker_id), (
            f"{job_id}: the killed worker's job should run again once, on the new worker")
    others = set(outcome.jobs) - in_flight
    assert all(outcome.jobs[j].attempts == 1 for j in others), "only the killed worker's jobs run twice"


def _where(stack: Stack, job_ids: set[str]) -> str:
    return ", ".join(f"{j}: {job.status} attempt {job.attempts} on {job.worker_id}"
                     for j in sorted(job_ids) for job in [stack.store.job(j)])


def test_worker_paused_past_dead_after_then_resumed_no_job_completes_twice(stack: Stack) -> None:
    workers = stack.start_workers(2)
    traffic = _traffic(stack, 5, "sigstop").start()
    longs = [traffic.submit(long_job(f"long {i}", 400, queue="documents")).job_id for i in range(4)]
    rows = wait_generating(stack.store, longs)
    holders = {row.worker_id for row in rows.values()}
    paused = next(w for w in workers if w.worker_id in holders)
    other = next(w for w in workers if w is not paused)

    paused.signal(signal.SIGSTOP)
    try:
        in_flight = running_on(stack.store, paused.worker_id)  # frozen now: it cannot claim more
        assert in_flight
        # The other worker's reconciler finds the silent worker dead and its jobs run there (attempt 2).
        wait_until(lambda: all(stack.store.job(j).worker_id == other.worker_id or
                               stack.store.job(j).status not in ("queued", "running") for j in in_flight),
                   "the paused worker's jobs to be requeued and taken by the other worker",
                   DEAD_AFTER_S + 60, describe=lambda: _where(stack, in_flight))
    finally:
        paused.signal(signal.SIGCONT)
    # The resumed worker still holds the old attempts in its engine: it finishes (or drops) them while it
    # beats again and the traffic goes on.
    wait_until(lambda: paused.worker_id in {w.id for w in stack.store.workers() if w.stopped_at is None},
               "the resumed worker to be registered as running", WAIT_S)
    traffic.wait_accepted(10)
    traffic.stop()

    outcome = check_exactly_once(stack.store, traffic.accepted(), within_s=SETTLE_S, max_attempts=2,
                                 stack=stack, reruns_allowed=in_flight)
    for job_id in in_flight:
        job = outcome.jobs[job_id]
        assert job.attempts == 2 and job.worker_id == other.worker_id, (
            f"{job_id}: expected its one outcome from the other worker's attempt 2, got attempt "
            f"{job.attempts} on {job.worker_id}")
    assert paused.alive(), "the resumed worker should keep running"
    # It is alive again in the store: its heartbeat resumed, and nobody stopped it.
    wait_until(lambda: paused.worker_id in {w.id for w in stack.store.workers() if w.stopped_at is None},
               "the resumed worker to be registered as running", WAIT_S)


@pytest.mark.parametrize("grace", ["short", "long"])
def test_worker_sigterm_requeues_or_finishes_its_jobs_once(stack: Stack, grace: str) -> None:
    """Short grace (1 s): the jobs in flight are handed back and run on the other worker, once. Long grace
    (300 s, far more than the jobs need even on a loaded machine): they finish in place, and the worker exits
    afterwards."""
    grace_s = {"short": 1, "long": 300}[grace]
    tokens = 1000  # about 7 s for four on the fault model, quiet: still running after the short grace
    traffic = stack.traffic(rate=1)
    if grace == "short":
        workers = stack.start_workers(2, WORKER_SHUTDOWN_GRACE_S=str(grace_s))
    else:
        workers = [stack.start_worker(WORKER_SHUTDOWN_GRACE_S=str(grace_s))]
    longs = [traffic.submit(long_job(f"long {i}", tokens, queue="documents")).job_id for i in range(4)]
    rows = wait_generating(stack.store, longs)
    holders = {row.worker_id for row in rows.values()}
    stopping = next(w for w in workers if w.worker_id in holders)
    in_flight = running_on(stack.store, stopping.worker_id)

    started = time.monotonic()
    stopping.signal(signal.SIGTERM)
    code = stopping.wait_exit(grace_s + WAIT_S)
    took = time.monotonic() - started
    assert code == 0, f"the worker exited with {code} on SIGTERM"
    if grace == "long":  # nothing is left to run them: they ended before the worker did, or never will
        unfinished = [describe(j) for j in stack.store.jobs(in_flight).values() if j.status != "succeeded"]
        assert not unfinished, f"the worker exited {took:.0f} s after SIGTERM leaving {unfinished}"

    outcome = check_exactly_once(stack.store, traffic.accepted(), within_s=SETTLE_S, stack=stack,
                                 max_attempts=2 if grace == "short" else 1)
    assert not {w.id for w in stack.store.workers() if w.id == stopping.worker_id and w.stopped_at is None}, (
        "the worker should mark itself stopped on its way out")
    if grace == "short":
        other = next(w for w in workers if w is not stopping)
        assert took < 30, f"a 1 s grace should not keep the worker {took:.0f} s"
        for job_id in in_flight:
            job = outcome.jobs[job_id]
            assert (job.attempts, job.worker_id) == (2, other.worker_id), (
                f"{job_id}: should be handed back at shutdown and run once on the other worker")
    else:
        for job_id in in_flight:
            job = outcome.jobs[job_id]
            assert (job.attempts, job.worker_id, job.completion_tokens) == (1, stopping.worker_id, tokens), (
                f"{job_id}: should finish in place within the grace period")


def test_two_workers_share_the_load_exactly_once(stack: Stack) -> None:
    workers = stack.start_workers(2)
    traffic = _traffic(stack, 10, "shared", max_tokens=8).start()
    wait_until(lambda: all(succeeded_on(stack.store, w.worker_id) for w in workers) and
               len(traffic.accepted()) >= 50, "both workers to finish jobs, with 50 accepted", WAIT_S)
    traffic.stop()

    assert not traffic.unsettled()
    outcome = check_exactly_once(stack.store, traffic.accepted(), within_s=SETTLE_S, max_attempts=1,
                                 stack=stack)
    assert len(outcome.jobs) >= 40
    by_worker = {w.worker_id: sum(1 for j in outcome.jobs.values() if j.worker_id == w.worker_id)
                 for w in workers}
    assert all(n > 0 for n in by_worker.values()), f"both workers should take jobs: {by_worker}"
