"""Service faults: Redis killed and restarted empty, PostgreSQL stopped (20 s and 35 s), the API SIGKILLed.

Each test runs a real `conveyor worker` on the suite's own PostgreSQL and Redis, submits steady traffic over
HTTP through the shared `conveyor api`, injects the fault, and ends with the central assertion
(check_exactly_once): every accepted job reaches a final state once, for the right reason.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from conveyor.core.store import republish_walk
from conveyor.core.store.tables import BrokerRepublish
from tests.support.fault_stack import LONG_OUTPUT_TOKENS, Stack
from tests.support.fault_store import SETTLE_S, WAIT_S, wait_until
from tests.support.faults import check_exactly_once, describe, wait_generating
from tests.support.traffic import Traffic, long_job, short_job

pytestmark = pytest.mark.faults

BACKLOG = 60  # jobs waiting in the broker when it dies
REPUBLISH_WINDOW_S = 20.0  # how long after the broker restart lost messages may take to be published again


def test_redis_killed_and_restarted_empty_lost_jobs_republished_under_traffic(
    stack: Stack, redis_restart_empty: Callable[..., None],
) -> None:
    """A worker allowed one interactive job at a time is held by a long "blocker" job while steady traffic
    (~10 jobs/s) piles up in the broker: 60+ jobs wait there. Redis dies with their messages and comes back
    empty while the traffic goes on and the blocker still holds the slot, so the queue never looks empty: the
    lost jobs must be published again all the same, before the queue drains, and every job ends once. None
    may expire (ttl 300 s)."""
    worker = stack.start_worker(QUEUES__INTERACTIVE__MAX_RUNNING="1")
    traffic = stack.traffic(rate=10, prefix="redis",
                            body=lambda i: short_job(f"redis {i}: a block table", 8, ttl=300))
    blocker = traffic.submit(long_job("blocker", LONG_OUTPUT_TOKENS)).job_id
    wait_generating(stack.store, [blocker])
    traffic.start()

    def backlog() -> set[str]:
        return {j.id for j in stack.store.jobs().values() if j.status == "queued" and j.dispatched_at}

    wait_until(lambda: len(backlog()) >= BACKLOG, f"{BACKLOG} jobs to wait in the broker", WAIT_S)
    lost = backlog()
    walks_before = _republish_walk(stack)
    redis_restart_empty(down_s=0.5)

    # The store tells what the broker cannot: the reconciler republishes with a walk whose row counts what it
    # published again (core/store/republish_walk.py); every lost job is still queued (the blocker holds the
    # queue's one slot), so the walk that ends must have published all of them, and more (the jobs published
    # between the restart and its detection). Reading Redis instead raced the worker, which takes and holds
    # messages as they come.
    def walked() -> BrokerRepublish | None:
        row = _republish_walk(stack)
        ended = row is not None and row.lost_before is None and row.generation > _generation(walks_before)
        return row if ended else None

    try:
        wait_until(lambda: walked() is not None, f"the {len(lost)} jobs lost with Redis to be published "
                   "again while new traffic keeps arriving", REPUBLISH_WINDOW_S, poll_s=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: the walk stands at {describe_walk(_republish_walk(stack))}; blocker: "
                             f"{describe(stack.store.job(blocker))}") from None
    walk = walked()
    assert walk is not None and walk.published >= len(lost), describe_walk(walk)
    blocker_row = stack.store.job(blocker)
    assert blocker_row.finished_at is None, (
        "the lost jobs were published again only once the blocker had ended and the queue could drain, not "
        f"while new traffic kept it busy: {describe(blocker_row)}")

    httpx.post(f"{stack.api_url}/v1/jobs/{blocker}/cancel", timeout=10)
    wait_until(lambda: stack.store.job(blocker).finished_at is not None, "the blocker to end", WAIT_S)
    traffic.stop()
    assert not traffic.unsettled()
    check_exactly_once(stack.store, traffic.accepted(), within_s=SETTLE_S, max_attempts=1, stack=stack,
                       expect={blocker: {"cancelled", "succeeded"}})
    log = worker.log()  # the reconnect path is clean: no ack on a dead channel, no failed step restart
    assert "ack failed" not in log and "Error on restarting" not in log, log[-4000:]


def _postgres_outage(stack: Stack, pg_outage: Callable[[float], None], seconds: float) -> Traffic:
    """A worker busy with long jobs and steady traffic when PostgreSQL stops for `seconds`."""
    stack.start_worker()
    traffic = stack.traffic(rate=10, prefix=f"pg{seconds:.0f}",
                      body=lambda i: short_job(f"pg {i}: the weather is fine", 8, ttl=600))
    longs = [traffic.submit(long_job(f"long {i}", 300, queue="documents")).job_id for i in range(3)]
    wait_generating(stack.store, longs)
    traffic.start()
    traffic.wait_accepted(10)
    pg_outage(seconds)  # the long jobs finish while it is down: their outcome writes must wait
    traffic.wait_accepted(20)  # the API takes jobs again
    traffic.stop()
    assert not traffic.unsettled(), [s.codes for s in traffic.unsettled()]
    return traffic


def test_postgres_stopped_35s_under_traffic_every_job_ends_once(
    stack: Stack, pg_outage: Callable[[float], None],
) -> None:
    # The outcome writer retries until the database is back (its waits double up to 5 s): 35 s spans several
    # of the longest waits and many of the worker's dead-after windows (4 s in these tests).
    traffic = _postgres_outage(stack, pg_outage, 35)
    # One worker that never died: no job may run twice (a live worker never requeues its own work).
    check_exactly_once(stack.store, traffic.accepted(), within_s=SETTLE_S, max_attempts=1, stack=stack)
    answers = traffic.answers()
    assert answers[503] > 0, f"submissions while the database was down should get 503: {answers}"
    assert answers[500] == 0, f"the API answered 500 (not 503) while the database was down: {answers}"


def test_api_sigkilled_between_submits_no_accepted_job_lost_or_duplicated(stack: Stack) -> None:
    stack.start_worker()
    traffic = stack.traffic(rate=10, prefix="apikill",
                      body=lambda i: short_job(f"api {i}: good morning", 8)).start()
    traffic.wait_accepted(20)
    stack.api.kill()  # SIGKILL
    traffic.wait_lost_answer()
    stack.api.start()
    traffic.wait_accepted(20)
    traffic.stop()

    assert not traffic.unsettled(), [s.codes for s in traffic.unsettled()]
    lost_answers = sum(1 for s in traffic.submissions if any(isinstance(c, str) for c in s.codes))
    assert lost_answers > 0, "the kill should have hit submissions in flight (connection errors, retried)"
    # One job per Idempotency-Key (no duplicate from a retried submit), none lost, each run once.
    check_exactly_once(stack.store, traffic.accepted(), within_s=SETTLE_S, max_attempts=1, stack=stack)


def _republish_walk(stack: Stack) -> BrokerRepublish | None:
    with stack.store.sessions() as session:
        return session.get(BrokerRepublish, republish_walk.ROW_ID)


def _generation(walk: BrokerRepublish | None) -> int:
    return walk.generation if walk is not None else 0


def describe_walk(walk: BrokerRepublish | None) -> str:
    if walk is None:
        return "no walk begun"
    return (f"walk {walk.generation}: {walk.published} published, lane {walk.lane}, lost before "
            f"{walk.lost_before}")
