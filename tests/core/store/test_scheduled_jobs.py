"""Scheduled jobs, retries on request and the retry policy in the store (SQLite and PostgreSQL): a scheduled
job is promoted only once due, in due order, once; a retry keeps the job's id and its earlier outcome; a
retryable failure waits out its backoff in `scheduled` until its retries are spent."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from conveyor.core.retry_policy import MODEL_UNAVAILABLE, OUT_OF_MEMORY, Backoff
from conveyor.core.store import job_tallies, jobs, keys, webhooks
from conveyor.core.store.database import make_db_engine, make_session_factory
from conveyor.core.store.jobs import retries
from conveyor.core.store.tables import DEFAULT_TENANT, Delivery, Job

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def add(session: Session, *, run_at: datetime | None = None, ttl_s: float | None = None,
        deadline_s: float | None = None, max_retries: int | None = None,
        webhook: dict[str, Any] | None = None, tenant: str = DEFAULT_TENANT, now: datetime = T0) -> str:
    new = jobs.NewJob(
        tenant_id=tenant, queue="interactive", prompt="hello", messages=None, params={"max_tokens": 4},
        meta=None, webhook=webhook, idempotency_key=None, request_hash="h", prompt_tokens=2, ttl_s=ttl_s,
        timeout_s=None, deadline_s=deadline_s, run_at=run_at, max_retries=max_retries,
    )
    return jobs.add(session, new, now).id


def job(session: Session, job_id: str) -> Job:
    row = jobs.get(session, job_id)
    assert row is not None
    return row


def test_a_job_due_later_is_scheduled_with_ttl_and_deadline_from_its_due_time(session: Session) -> None:
    scheduled = job(session, add(session, run_at=at(60), ttl_s=10, deadline_s=30))
    assert (scheduled.status, scheduled.run_at) == ("scheduled", at(60))
    assert (scheduled.expires_at, scheduled.deadline_at) == (at(70), at(90))
    past = job(session, add(session, run_at=at(-5)))  # a time already past: queued now, as Celery's eta
    assert (past.status, past.run_at) == ("queued", None)
    assert jobs.count_scheduled(session) == {"interactive": 1}
    counts = job_tallies.queue_counts(session, T0, may_fold=True)  # the queue's depth: the queued one only
    assert counts["interactive"].queued == 1


def test_due_jobs_are_promoted_once_in_due_order_and_never_early(session: Session) -> None:
    later, sooner, far = (add(session, run_at=at(s)) for s in (20, 10, 3600))
    assert jobs.promote_due(session, at(9.999)) == []
    assert jobs.next_due(session) == at(10)
    assert jobs.promote_due(session, at(20)) == [(sooner, "interactive"), (later, "interactive")]
    assert jobs.promote_due(session, at(20)) == []  # a second scheduler finds nothing
    assert [job(session, j).status for j in (sooner, later, far)] == ["queued", "queued", "scheduled"]
    assert job(session, sooner).dispatched_at is None  # the reconciler publishes it if the promoter dies
    assert {j for j, _ in jobs.undispatched(session, at(21))} == {sooner, later}


def test_promotion_goes_in_chunks(session: Session) -> None:
    ids = [add(session, run_at=at(1 + i / 10)) for i in range(7)]
    assert [j for j, _ in jobs.promote_due(session, at(5), batch=3)] == ids


def test_a_scheduled_job_is_cancellable_deletable_and_purged(session: Session) -> None:
    cancelled = add(session, run_at=at(60))
    row = jobs.cancel(session, cancelled, DEFAULT_TENANT, T0)
    assert row is not None and row.status == "cancelled"
    deleted = add(session, run_at=at(60))
    assert jobs.delete_finished(session, deleted, DEFAULT_TENANT).deleted
    purged = [add(session, run_at=at(60)), add(session)]
    assert sorted(jobs.cancel_queued(session, ["interactive"], DEFAULT_TENANT, T0, 10)) == sorted(purged)


def test_a_retry_runs_the_job_again_under_its_id_keeping_its_outcome(session: Session) -> None:
    job_id = add(session, ttl_s=30)
    assert jobs.claim(session, job_id, "w1", at(1)) is not None
    assert jobs.fail(session, job_id, 1, code="engine_error", message="boom", now=at(2))
    result = jobs.retry(session, job_id, DEFAULT_TENANT, at(100), key="k1")
    assert result.applied and result.job is not None
    again = result.job
    assert (again.status, again.attempts, again.error_code, again.finished_at) == ("queued", 1, None, None)
    assert (again.expires_at, again.run_at) == (at(130), at(100))  # its ttl counts from the retry
    [kept] = again.history or []
    assert (kept["attempt"], kept["status"], kept["error"]) == (
        1, "failed", {"code": "engine_error", "message": "boom"})
    replay = jobs.retry(session, job_id, DEFAULT_TENANT, at(101), key="k1")
    assert replay.replayed and not replay.applied
    assert len(job(session, job_id).history or []) == 1

    claimed = jobs.claim(session, job_id, "w2", at(102))
    assert claimed is not None and claimed.attempts == 2
    refused = jobs.retry(session, job_id, DEFAULT_TENANT, at(103), key="k2")  # running: not retryable
    assert not refused.applied and not refused.replayed and refused.job is not None


def test_a_retry_may_be_scheduled_and_only_final_jobs_of_the_tenant_are_retried(session: Session) -> None:
    job_id = add(session)
    assert not jobs.retry(session, job_id, DEFAULT_TENANT, T0).applied  # queued
    jobs.cancel(session, job_id, DEFAULT_TENANT, T0)
    assert jobs.retry(session, job_id, "someone-else", T0).job is None
    result = jobs.retry(session, job_id, DEFAULT_TENANT, at(1), run_at=at(50))
    assert result.applied and result.job is not None
    assert (result.job.status, result.job.run_at) == ("scheduled", at(50))


def _fail_step(session: Session, job_id: str, attempt: int, code: str, now: datetime) -> list[str]:
    return jobs.record_step(session, [], [jobs.Failure(job_id, attempt, code, "no memory")], now)


def test_a_retryable_failure_is_rescheduled_after_a_backoff_until_its_retries_are_spent(
    session: Session,
) -> None:
    job_id = add(session, max_retries=1)
    assert jobs.claim(session, job_id, "w1", at(1)) is not None
    assert _fail_step(session, job_id, 1, OUT_OF_MEMORY, at(2)) == []  # not final: rescheduled
    waiting = job(session, job_id)
    assert (waiting.status, waiting.retries, waiting.worker_id) == ("scheduled", 1, None)
    assert waiting.run_at is not None and at(3) <= waiting.run_at <= at(4)  # 2 s base, half to all of it
    assert jobs.promote_due(session, waiting.run_at) == [(job_id, "interactive")]
    assert jobs.claim(session, job_id, "w1", at(5)) is not None
    assert _fail_step(session, job_id, 2, MODEL_UNAVAILABLE, at(6)) == [job_id]  # its one retry is spent
    failed = job(session, job_id)
    assert (failed.status, failed.error_code, failed.attempts) == ("failed", MODEL_UNAVAILABLE, 2)
    assert [entry["error"]["code"] for entry in failed.history or []] == [OUT_OF_MEMORY]


def test_the_requests_own_errors_are_never_retried(session: Session) -> None:
    job_id = add(session, max_retries=3)
    assert jobs.claim(session, job_id, "w1", at(1)) is not None
    assert _fail_step(session, job_id, 1, "invalid_request", at(2)) == [job_id]
    assert job(session, job_id).status == "failed"


def test_a_lost_worker_counts_against_the_jobs_own_max_retries(session: Session) -> None:
    none_left, default = add(session, max_retries=0), add(session)
    for job_id in (none_left, default):
        assert jobs.claim(session, job_id, "dead", at(1)) is not None
    assert jobs.fail_lost(session, ["dead"], at(2), max_attempts=3) == [none_left]
    assert jobs.requeue_orphans(session, ["dead"], at(2)) == [(default, "interactive")]
    assert job(session, default).retries == 1


def test_backoff_doubles_up_to_its_cap_with_jitter() -> None:
    backoff = Backoff(base_s=2, cap_s=10)
    for retry, ceiling in ((1, 2), (2, 4), (3, 8), (4, 10), (50, 10)):
        delays = [backoff.delay_s(retry) for _ in range(50)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays), (retry, delays)
        assert len(set(delays)) > 1  # jittered: jobs failing together do not come back together


def test_job_started_events_go_only_to_targets_that_ask_for_them(session: Session) -> None:
    asked = add(session, webhook={"url": "https://own.example/hook", "events": ["job.started", "job.*"]})
    plain = add(session, webhook={"url": "https://own.example/other"})
    jobs.claim_many(session, [asked, plain], "w1", at(1))
    session.commit()
    deliveries = session.query(Delivery).filter(Delivery.subject_id.in_([asked, plain])).all()
    assert [(d.subject_id, d.event_type) for d in deliveries] == [(asked, "job.started")]
    assert deliveries[0].payload["data"]["status"] == "running"
    assert webhooks.enabled_subscriptions_of(session, {DEFAULT_TENANT}) == {}


def test_a_retry_that_read_the_job_before_another_retry_and_cancel_keeps_every_outcome(
        migrated_sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between a retry's read and its write, another client retries the job and cancels it again (the
    status is back to what the first read): the first retry must not write its stale history over the
    other's. SQLite takes no row lock on the read, so the write itself must notice (on PostgreSQL the read's
    FOR UPDATE makes the other client wait, so this interleaving cannot happen there)."""
    db_engine = make_db_engine(migrated_sqlite_url)
    session_factory = make_session_factory(db_engine)
    with session_factory() as setup:
        job_id = add(setup)
        jobs.cancel(setup, job_id, DEFAULT_TENANT, at(1))
    real_open_batch_of = retries.open_batch_of
    interleaved: list[bool] = []

    def another_client_in_between(session: Session, checked_id: str) -> str | None:
        if not interleaved:
            interleaved.append(True)
            with session_factory() as other:
                assert jobs.retry(other, job_id, DEFAULT_TENANT, at(2)).applied
                jobs.cancel(other, job_id, DEFAULT_TENANT, at(3))
        return real_open_batch_of(session, checked_id)

    monkeypatch.setattr(retries, "open_batch_of", another_client_in_between)
    with session_factory() as first:
        result = jobs.retry(first, job_id, DEFAULT_TENANT, at(4))
        history = [entry["status"] for entry in job(first, job_id).history or []]
    db_engine.dispose()
    assert history == (["cancelled", "cancelled"] if result.applied else ["cancelled"])


def _scheduled_rows(session: Session, tenant: str | None = None) -> dict[str, int]:
    """What the scheduled counts should say: a count of the jobs table."""
    query = select(Job.queue, func.count()).where(Job.status == "scheduled").group_by(Job.queue)
    if tenant is not None:
        query = query.where(Job.tenant_id == tenant)
    return {queue: int(n) for queue, n in session.execute(query)}


def test_scheduled_counts_follow_schedule_promote_cancel_and_backoff_from_the_tallies(
    session: Session,
) -> None:
    """count_scheduled and count_scheduled_in read the tallies (migration 0026): right after every move into
    and out of `scheduled`, before and after a fold, and apart from the depth, the load and the output
    bound."""
    keys.ensure_tenant(session, "bob", T0)
    soon, later, cancelled = (add(session, run_at=at(s)) for s in (10, 20, 30))
    add(session, run_at=at(40), tenant="bob")
    backoff = add(session, max_retries=1)

    def check(default: int, bob: int) -> None:
        assert jobs.count_scheduled(session) == _scheduled_rows(session)
        assert jobs.count_scheduled(session, "bob") == _scheduled_rows(session, "bob")
        assert jobs.count_scheduled_in(session, "interactive", DEFAULT_TENANT) == default
        assert jobs.count_scheduled_in(session, "interactive", "bob") == bob

    check(3, 1)
    assert jobs.promote_due(session, at(10)) == [(soon, "interactive")]
    check(2, 1)
    assert jobs.cancel(session, cancelled, DEFAULT_TENANT, T0) is not None
    check(1, 1)
    assert jobs.claim(session, backoff, "w1", at(11)) is not None
    assert _fail_step(session, backoff, 1, OUT_OF_MEMORY, at(12)) == []  # running -> scheduled
    check(2, 1)
    job_tallies.fold(session)
    check(2, 1)
    tally = job_tallies.tallies(session)["interactive"]
    assert (tally.scheduled, tally.queued, tally.running, tally.load) == (3, 1, 0, 1)
    assert tally.output_bound == 4  # the queued job's max_tokens only
    assert job_tallies.queue_counts(session, T0)["interactive"].scheduled == 3
    assert job_tallies.per_tenant(session)["bob"] == job_tallies.QueueTally(scheduled=1)
    assert jobs.promote_due(session, at(3600)) and jobs.count_scheduled(session) == {}
    assert job(session, later).status == "queued"
