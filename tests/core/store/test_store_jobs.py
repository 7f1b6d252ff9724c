"""Conditional transitions: a late or duplicate report can't complete twice or revive a cancelled job."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from sqlalchemy.orm import Session

from core.store import jobs
from core.store.tables import DEFAULT_TENANT

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)


def add_job(
    session: Session, *, ttl_s: float | None = None, queue: str = "interactive", at: datetime = T0
) -> str:
    new = jobs.NewJob(
        tenant_id=DEFAULT_TENANT, queue=queue, prompt="hello", messages=None, params={"max_tokens": 4},
        meta=None, webhook=None, idempotency_key=None, request_hash="h", prompt_tokens=2, ttl_s=ttl_s,
        timeout_s=None,
    )
    return jobs.add(session, new, at).id


def complete(session: Session, job_id: str, attempt: int, text: str = "out", at: datetime = T0) -> bool:
    return jobs.complete(session, job_id, attempt, result_text=text, finish_reason="stop", prompt_tokens=2,
                         completion_tokens=3, preemptions=1, first_token_at=at, now=at)


def test_claim_then_complete_once(session: Session) -> None:
    job_id = add_job(session)
    claimed = jobs.claim(session, job_id, "w1", T0 + timedelta(seconds=1))
    assert claimed is not None and claimed.status == "running" and claimed.attempts == 1
    assert claimed.started_at == T0 + timedelta(seconds=1) and claimed.worker_id == "w1"
    assert jobs.claim(session, job_id, "w2", T0) is None  # a duplicate message can't claim it again
    assert complete(session, job_id, 1, "first", T0 + timedelta(seconds=2))
    assert not complete(session, job_id, 1, "second", T0 + timedelta(seconds=3))
    job = jobs.get(session, job_id)
    assert job is not None and job.status == "succeeded" and job.result_text == "first"
    assert job.finished_at == T0 + timedelta(seconds=2) and job.preemptions == 1
    assert not jobs.fail(session, job_id, 1, code="x", message="late", now=T0)


def test_cancelled_job_is_never_revived(session: Session) -> None:
    job_id = add_job(session)
    assert jobs.claim(session, job_id, "w1", T0) is not None
    cancelled = jobs.cancel(session, job_id, DEFAULT_TENANT, T0)
    assert cancelled is not None and cancelled.status == "cancelled"
    states = jobs.attempt_states(session, [job_id, "job_other"])
    assert states == {job_id: jobs.AttemptState("cancelled", 1, "w1")}
    assert not complete(session, job_id, 1)
    assert not jobs.fail(session, job_id, 1, code="boom", message="late", now=T0)
    assert jobs.claim(session, job_id, "w2", T0) is None
    assert jobs.requeue_orphans(session, ["w1"], T0) == []
    job = jobs.get(session, job_id)
    assert job is not None and job.status == "cancelled" and job.result_text is None


def test_attempt_mismatch_is_rejected(session: Session) -> None:
    job_id = add_job(session)
    assert jobs.claim(session, job_id, "w1", T0) is not None
    assert jobs.requeue_orphans(session, ["w1"], T0) == [(job_id, "interactive")]
    second = jobs.claim(session, job_id, "w2", T0 + timedelta(seconds=5))
    assert second is not None and second.attempts == 2
    assert not jobs.record_first_token(session, job_id, 1, T0)
    assert not complete(session, job_id, 1, "stale")  # the dead worker's attempt reports late
    assert jobs.record_first_token(session, job_id, 2, T0 + timedelta(seconds=6))
    assert complete(session, job_id, 2, "fresh")
    job = jobs.get(session, job_id)
    assert job is not None and job.result_text == "fresh" and job.attempts == 2
    assert job.first_token_at == T0 + timedelta(seconds=6)  # the one recorded while running is kept


def test_fail_records_code_and_message(session: Session) -> None:
    job_id = add_job(session)
    assert jobs.claim(session, job_id, "w1", T0) is not None
    assert jobs.fail(session, job_id, 1, code="timeout", message="ran over 1 s", now=T0)
    job = jobs.get(session, job_id)
    assert job is not None
    assert (job.status, job.error_code, job.error_message) == ("failed", "timeout", "ran over 1 s")


def test_claim_after_ttl_expires_the_job(session: Session) -> None:
    job_id = add_job(session, ttl_s=10)
    assert jobs.claim(session, job_id, "w1", T0 + timedelta(seconds=11)) is None
    job = jobs.get(session, job_id)
    assert job is not None and job.status == "expired" and job.error_code == "expired"
    assert job.started_at is None and job.attempts == 0


def test_expire_overdue_only_touches_queued_jobs_past_ttl(session: Session) -> None:
    overdue = add_job(session, ttl_s=5)
    fresh = add_job(session, ttl_s=60)
    forever = add_job(session)
    running = add_job(session, ttl_s=5)
    assert jobs.claim(session, running, "w1", T0) is not None
    assert jobs.expire_overdue(session, T0 + timedelta(seconds=6)) == [overdue]
    statuses = {j: jobs.get(session, j).status for j in (overdue, fresh, forever, running)}  # type: ignore[union-attr]
    assert statuses == {overdue: "expired", fresh: "queued", forever: "queued", running: "running"}
    assert jobs.expire_overdue(session, T0 + timedelta(seconds=6)) == []


def test_undispatched_and_mark_dispatched(session: Session) -> None:
    old = add_job(session, at=T0)
    new = add_job(session, at=T0 + timedelta(seconds=10))
    dispatched = add_job(session, at=T0)
    jobs.mark_dispatched(session, [dispatched], T0)
    assert jobs.undispatched(session, T0 + timedelta(seconds=5)) == [(old, "interactive")]
    assert {j for j, _ in jobs.undispatched(session, T0 + timedelta(seconds=11))} == {old, new}
    jobs.mark_dispatched(session, [old, new], T0 + timedelta(seconds=11))
    assert jobs.undispatched(session, T0 + timedelta(seconds=60)) == []


def test_requeued_orphan_is_undispatched_again(session: Session) -> None:
    job_id = add_job(session, queue="documents")
    jobs.mark_dispatched(session, [job_id], T0)
    assert jobs.claim(session, job_id, "dead", T0) is not None
    assert jobs.requeue_orphans(session, ["dead"], T0) == [(job_id, "documents")]
    assert jobs.undispatched(session, T0 + timedelta(seconds=1)) == [(job_id, "documents")]
    assert jobs.requeue_orphans(session, ["dead"], T0) == []  # a second reconciler pass finds nothing


def test_cancel_is_scoped_to_the_tenant(session: Session) -> None:
    job_id = add_job(session)
    assert jobs.cancel(session, job_id, "someone-else", T0) is None
    job = jobs.get(session, job_id)
    assert job is not None and job.status == "queued"


def test_cancel_of_a_finished_job_reports_its_status(session: Session) -> None:
    job_id = add_job(session)
    assert jobs.claim(session, job_id, "w1", T0) is not None
    assert complete(session, job_id, 1)
    job = jobs.cancel(session, job_id, DEFAULT_TENANT, T0)
    assert job is not None and job.status == "succeeded"


def test_queue_counts(session: Session) -> None:
    add_job(session, at=T0 + timedelta(seconds=3))
    add_job(session, at=T0 + timedelta(seconds=1))
    running = add_job(session, queue="documents")
    assert jobs.claim(session, running, "w1", T0) is not None
    counts = jobs.queue_counts(session)
    assert counts["interactive"] == jobs.QueueCounts(2, 0, T0 + timedelta(seconds=1))
    assert counts["documents"] == jobs.QueueCounts(0, 1, None)
    assert jobs.count_queued(session, "interactive") == 2
