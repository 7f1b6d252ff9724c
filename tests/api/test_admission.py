"""AdmissionGauge: a queue's queued count is estimated (last COUNT plus this process's admissions) and
re-counted only when the estimate is older than refresh_s or says the queue is full. A fake clock drives
time; rows inserted behind the gauge's back show when it counts and when it does not."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy.orm import Session

from conveyor.api.admission import AdmissionGauge
from conveyor.core.store import jobs
from conveyor.core.store.tables import DEFAULT_TENANT

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
REFRESH_S = 0.5


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def queue_jobs(session: Session, n: int, queue: str = "interactive") -> list[str]:
    new = jobs.NewJob(
        tenant_id=DEFAULT_TENANT, queue=queue, prompt="hello", messages=None, params={}, meta=None,
        webhook=None, idempotency_key=None, request_hash="h", prompt_tokens=1, ttl_s=None, timeout_s=None,
    )
    return [jobs.add(session, new, T0).id for _ in range(n)]


def test_first_use_counts_only_that_queues_queued_jobs(session: Session) -> None:
    queue_jobs(session, 2)
    queue_jobs(session, 1, queue="documents")
    running = queue_jobs(session, 1)
    assert jobs.claim_many(session, running, "w1", T0)
    gauge = AdmissionGauge(REFRESH_S, FakeClock())
    gauge.admitted("interactive")  # before any count: nothing to add to
    assert not gauge.has_room(session, "interactive", 2)
    assert gauge.has_room(session, "documents", 2)
    assert not gauge.has_room(session, "documents", 1)  # full: counted again, still 1


def test_within_refresh_s_it_admits_on_the_estimate_until_that_reaches_the_cap(session: Session) -> None:
    clock = FakeClock()
    gauge = AdmissionGauge(REFRESH_S, clock)
    queue_jobs(session, 1)
    assert gauge.has_room(session, "interactive", 3)  # counted: 1
    queue_jobs(session, 5)  # another process's jobs: the store now holds 6, the estimate says 1
    clock.now += REFRESH_S / 2
    assert gauge.has_room(session, "interactive", 3)
    gauge.admitted("interactive")  # estimate 2
    assert gauge.has_room(session, "interactive", 3)
    gauge.admitted("interactive")  # estimate 3: full, so the next question counts (6)
    assert not gauge.has_room(session, "interactive", 3)


def test_a_full_estimate_is_counted_again_at_once(session: Session) -> None:
    gauge = AdmissionGauge(REFRESH_S, FakeClock())  # the clock never moves
    waiting = queue_jobs(session, 2)
    assert not gauge.has_room(session, "interactive", 2)
    assert len(jobs.claim_many(session, waiting, "w1", T0)) == 2  # the queue drained
    assert gauge.has_room(session, "interactive", 2)
    gauge.admitted("interactive")
    gauge.admitted("interactive")  # estimate 2, but nothing was inserted
    assert gauge.has_room(session, "interactive", 2)


def test_after_refresh_s_it_counts_again(session: Session) -> None:
    clock = FakeClock()
    gauge = AdmissionGauge(REFRESH_S, clock)
    assert gauge.has_room(session, "interactive", 3)  # counted: 0
    queue_jobs(session, 3)
    clock.now += REFRESH_S * 0.9
    assert gauge.has_room(session, "interactive", 3)  # still the estimate
    clock.now += REFRESH_S * 0.2
    assert not gauge.has_room(session, "interactive", 3)
