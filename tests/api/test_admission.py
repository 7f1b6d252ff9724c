"""AdmissionGauge: a queue's queued count is estimated (last count plus this process's admissions) and
counted again only when the estimate is older than refresh_s or says the queue is full; a count reads the
job tallies, never the rows. A fake clock drives time; rows inserted behind the gauge's back show when it
counts and when it does not."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.orm import Session

from conveyor.api.admission import AdmissionGauge, queued_refusal, scheduled_refusal
from conveyor.core.store import jobs, keys
from conveyor.core.store.tables import DEFAULT_TENANT, JobTallyDelta
from conveyor.core.store.tenants import TenantLimits

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
REFRESH_S = 0.5


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def queue_jobs(session: Session, n: int, queue: str = "interactive", tenant: str = DEFAULT_TENANT,
               run_at: datetime | None = None) -> list[str]:
    new = jobs.NewJob(
        tenant_id=tenant, queue=queue, prompt="hello", messages=None, params={}, meta=None,
        webhook=None, idempotency_key=None, request_hash="h", prompt_tokens=1, ttl_s=None, timeout_s=None,
        run_at=run_at,
    )
    return [jobs.add(session, new, T0).id for _ in range(n)]


@contextmanager
def statements(session: Session) -> Iterator[list[str]]:
    """The SQL the session sends meanwhile."""
    sent: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        sent.append(statement)

    bind = session.get_bind()
    event.listen(bind, "before_cursor_execute", record)
    try:
        yield sent
    finally:
        event.remove(bind, "before_cursor_execute", record)


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


def test_a_stale_estimate_is_counted_by_one_submit_while_the_others_answer_from_it(
    session: Session, monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = FakeClock()
    gauge = AdmissionGauge(REFRESH_S, clock)
    assert gauge.has_room(session, "interactive", 3)  # counted: 0
    clock.now += REFRESH_S * 2
    counting, release = threading.Event(), threading.Event()
    counted: list[str] = []

    def slow_count(*_args: Any) -> int:
        counted.append("count")
        counting.set()
        assert release.wait(10), "the test never released the count"
        return 3

    monkeypatch.setattr(jobs, "count_queued", slow_count)
    first = threading.Thread(target=lambda: gauge.has_room(session, "interactive", 3))
    first.start()
    assert counting.wait(10)
    assert gauge.has_room(session, "interactive", 3)  # stale, but being counted: answered from it
    release.set()
    first.join(10)
    assert counted == ["count"]
    assert not gauge.has_room(session, "interactive", 3)  # the count (3) is in: full, and counted again
    assert counted == ["count", "count"]


def test_a_count_reads_the_tallies_not_the_rows_whatever_max_queued(session: Session) -> None:
    """At a max_queued of 1,000,000 a count read up to the limit in rows; the tallies answer in a few rows:
    a backlog the tallies hold (written straight into them here, with no job rows) is what it refuses on."""
    queue_jobs(session, 1)
    session.add(JobTallyDelta(queue="interactive", tenant_id=DEFAULT_TENANT, status="queued", jobs=999_998,
                              output_bound=0))
    session.commit()
    gauge = AdmissionGauge(REFRESH_S, FakeClock())
    with statements(session) as first:
        assert gauge.has_room(session, "interactive", 1_000_000)  # 999,999
    queue_jobs(session, 1)
    with statements(session) as second:
        assert not gauge.has_room(session, "interactive", 1_000_000, DEFAULT_TENANT)  # 1,000,000
    for sent in (first, second):
        assert len(sent) == 1 and "job_tallies" in sent[0], sent
        assert not re.search(r"\b(FROM|JOIN) jobs\b", sent[0]), sent


def test_a_tenant_is_refused_at_its_own_max_queued_and_max_scheduled_others_are_not(session: Session) -> None:
    keys.ensure_tenant(session, "alice", T0)
    keys.ensure_tenant(session, "bob", T0)
    session.commit()
    queue_jobs(session, 2, tenant="alice")
    queue_jobs(session, 1, tenant="bob")
    queue_jobs(session, 2, tenant="alice", run_at=T0.replace(year=2030))  # scheduled: not in the depth
    gauge = AdmissionGauge(REFRESH_S, FakeClock())
    limits = TenantLimits(max_queued=2)
    refusal = queued_refusal(session, gauge, limits, "alice", "interactive", 7)
    assert refusal is not None and (refusal.code, refusal.retry_after_s) == ("tenant_queue_full", 7)
    assert queued_refusal(session, gauge, limits, "bob", "interactive", 7) is None
    assert gauge.has_room(session, "interactive", 4)  # 3 queued in the queue: the scheduled ones apart
    refusal = scheduled_refusal(session, 2, "alice", "interactive", 7)
    assert refusal is not None and refusal.code == "tenant_schedule_full"
    assert scheduled_refusal(session, 3, "alice", "interactive", 7) is None
    assert scheduled_refusal(session, 1, "bob", "interactive", 7) is None
