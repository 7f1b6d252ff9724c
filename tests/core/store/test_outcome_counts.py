"""The outcome counters behind the API's job metrics: counted once per job in its final transition (a
transition that loses a race counts nothing), histograms bucketed by the shared bounds, failures by code,
batch lines by outcome and webhook attempts by outcome, jobs with a deadline by goodput tier and outcome (the
same counts as /v1/queues reads from the jobs table); on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session

from conveyor.core.protocol.service_tiers import goodput_tier
from conveyor.core.store import batches, jobs, outcome_counts
from conveyor.core.store.outcome_counts import (
    BATCH_LINES,
    E2E,
    JOB_DEADLINES,
    JOB_FAILURES,
    LATE,
    LATENESS,
    MISSED,
    ON_TIME,
    QUEUE_TIME,
    TTFT,
    WEBHOOK_DELIVERIES,
)
from conveyor.core.store.tables import DEFAULT_TENANT, BatchLine, Job

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def add_job(session: Session, queue: str = "interactive", ttl_s: float | None = None,
            deadline_s: float | None = None, service_tier: str | None = None) -> str:
    new = jobs.NewJob(
        tenant_id=DEFAULT_TENANT,
        queue=queue,
        prompt="hi",
        messages=None,
        params={"max_tokens": 4},
        meta=None,
        webhook=None,
        idempotency_key=None,
        request_hash="h",
        prompt_tokens=2,
        ttl_s=ttl_s,
        timeout_s=None,
        deadline_s=deadline_s,
        service_tier=service_tier,
    )
    return jobs.add(session, new, T0).id


def counts(session: Session) -> dict[tuple[str, str, str, str], tuple[int, float]]:
    return {
        (r.metric, r.queue, r.status, r.label): (r.count, r.total) for r in outcome_counts.all_counts(session)
    }


def test_bucket_labels_are_the_upper_bounds() -> None:
    assert outcome_counts.bucket_label(0.0) == "0.05"
    assert outcome_counts.bucket_label(0.05) == "0.05"  # le: a bound holds its own value
    assert outcome_counts.bucket_label(0.3) == "0.5"
    assert outcome_counts.bucket_label(1e6) == "+Inf"


def test_a_job_is_counted_once_when_it_finishes(session: Session) -> None:
    job_id = add_job(session)
    assert jobs.claim(session, job_id, "w1", at(0.3)) is not None
    assert jobs.record_first_token(session, job_id, 1, at(0.4))
    done = dict(
        result_text="x",
        finish_reason="stop",
        prompt_tokens=2,
        completion_tokens=1,
        preemptions=0,
        first_token_at=None,
    )
    assert jobs.complete(session, job_id, 1, now=at(2.0), **done)
    assert not jobs.complete(session, job_id, 1, now=at(3.0), **done)  # a duplicate report counts nothing
    assert counts(session) == {
        (QUEUE_TIME, "interactive", "succeeded", "0.5"): (1, 0.3),
        (TTFT, "interactive", "succeeded", "0.5"): (1, 0.4),
        (E2E, "interactive", "succeeded", "2.5"): (1, 2.0),
        (outcome_counts.JOBS_FINISHED, "interactive", "succeeded", ""): (1, 0.0),  # 0 preemptions
    }


def test_failures_expiries_and_cancels_per_status(session: Session) -> None:
    failed, expired, cancelled = add_job(session), add_job(session, "documents", ttl_s=1.0), add_job(session)
    assert jobs.claim(session, failed, "w1", at(1.0)) is not None
    assert jobs.fail(session, failed, 1, code="timeout", message="ran too long", now=at(5.0))
    assert jobs.expire_overdue(session, at(30.0)) == [expired]
    assert jobs.cancel(session, cancelled, DEFAULT_TENANT, at(0.2)) is not None
    found = counts(session)
    assert found[(JOB_FAILURES, "interactive", "", "timeout")] == (1, 0.0)
    assert found[(JOB_FAILURES, "documents", "", "expired")] == (1, 0.0)
    assert found[(QUEUE_TIME, "documents", "expired", "30.0")] == (1, 30.0)  # waited until it expired
    assert found[(E2E, "interactive", "cancelled", "0.25")] == (1, 0.2)
    assert not any(key[0] == TTFT for key in found)  # none of them had a first token
    e2e_total = sum(n for (metric, *_), (n, _) in found.items() if metric == E2E)
    assert e2e_total == 3


def test_batch_lines_and_webhook_attempts_by_outcome(session: Session) -> None:
    batch = batches.create(
        session,
        tenant_id=DEFAULT_TENANT,
        input_url="s3://b/in.jsonl",
        output_url=None,
        queue="documents",
        now=T0,
    )
    job_id = add_job(session, "documents")
    session.add(BatchLine(batch_id=batch.id, line=1, custom_id="a", status="queued", job_id=job_id))
    session.execute(update(Job).where(Job.id == job_id).values(batch_id=batch.id))  # as the batch runner
    session.commit()
    assert jobs.cancel(session, job_id, DEFAULT_TENANT, at(1.0)) is not None
    outcome_counts.record_webhook_attempt(session, "retry")
    outcome_counts.record_webhook_attempt(session, "retry")
    outcome_counts.record_webhook_attempt(session, "delivered")
    session.commit()
    found = counts(session)
    assert found[(BATCH_LINES, "documents", "", "cancelled")] == (1, 0.0)
    assert found[(WEBHOOK_DELIVERIES, "", "", "retry")] == (2, 0.0)
    assert found[(WEBHOOK_DELIVERIES, "", "", "delivered")] == (1, 0.0)


def test_jobs_with_a_deadline_count_on_time_late_or_missed_and_how_late(session: Session) -> None:
    done = dict(result_text="x", finish_reason="stop", prompt_tokens=2, completion_tokens=1, preemptions=0,
                first_token_at=None)
    on_time, late, missed = (add_job(session, deadline_s=1.0) for _ in range(3))
    add_job(session)  # no deadline: counted in no deadline series
    for job_id in (on_time, late):
        assert jobs.claim(session, job_id, "w1", at(0.1)) is not None
    assert jobs.complete(session, on_time, 1, now=at(1.0), **done)  # at its deadline: on time
    assert jobs.complete(session, late, 1, now=at(1.3), **done)
    # Cancelled before its deadline: it delivered nothing, so it missed it.
    assert jobs.cancel(session, missed, DEFAULT_TENANT, at(0.5)) is not None
    found = {key: value for key, value in counts(session).items() if key[0] in (JOB_DEADLINES, LATENESS)}
    assert found == {
        (JOB_DEADLINES, "interactive", "default", ON_TIME): (1, 0.0),
        (JOB_DEADLINES, "interactive", "default", LATE): (1, 0.0),
        (JOB_DEADLINES, "interactive", "default", MISSED): (1, 0.0),
        (LATENESS, "interactive", "succeeded", "0.5"): (1, pytest.approx(0.3)),
    }


def test_deadline_outcomes_count_per_goodput_tier_alike_in_the_metrics_and_the_jobs_table(
    session: Session,
) -> None:
    """The tier is kept in the row's `status` column: none, auto and default are one tier, `default`; the
    last hour's counts read from the jobs table (/v1/queues) give the same figures per queue and tier."""
    done = dict(result_text="x", finish_reason="stop", prompt_tokens=2, completion_tokens=1, preemptions=0,
                first_token_at=None)
    priority_on_time = add_job(session, deadline_s=1.0, service_tier="priority")
    flex_late = add_job(session, "documents", deadline_s=1.0, service_tier="flex")
    auto_missed = add_job(session, deadline_s=1.0, service_tier="auto")
    default_on_time = add_job(session, deadline_s=1.0, service_tier="default")
    untiered_on_time = add_job(session, deadline_s=1.0)
    add_job(session, service_tier="priority")  # no deadline: in no deadline series
    for job_id, end in ((priority_on_time, 0.5), (flex_late, 4.0), (default_on_time, 1.0),
                        (untiered_on_time, 0.9)):
        assert jobs.claim(session, job_id, "w1", at(0.1)) is not None
        assert jobs.complete(session, job_id, 1, now=at(end), **done)
    assert jobs.cancel(session, auto_missed, DEFAULT_TENANT, at(0.2)) is not None
    found = {key: n for key, (n, _) in counts(session).items() if key[0] == JOB_DEADLINES}
    assert found == {
        (JOB_DEADLINES, "interactive", "priority", ON_TIME): 1,
        (JOB_DEADLINES, "documents", "flex", LATE): 1,
        (JOB_DEADLINES, "interactive", "default", MISSED): 1,
        (JOB_DEADLINES, "interactive", "default", ON_TIME): 2,
    }
    from_jobs = jobs.deadline_counts(session, since=T0)
    assert from_jobs == {
        "interactive": {"priority": {ON_TIME: 1}, "default": {MISSED: 1, ON_TIME: 2}},
        "documents": {"flex": {LATE: 1}},
    }
    assert jobs.deadline_counts(session, since=at(5.0)) == {}  # ended before the window
    assert jobs.deadline_counts(session, since=T0, tenant_id="someone-else") == {}


def test_goodput_tiers_and_rows_from_before_tiers_count_as_the_default_tier() -> None:
    tiers = [goodput_tier(t) for t in (None, "auto", "default", "flex", "priority")]
    assert tiers == ["default", "default", "default", "flex", "priority"]
    rows = [outcome_counts.row_tier(status) for status in ("", "default", "flex", "priority")]
    assert rows == ["default", "default", "flex", "priority"]
