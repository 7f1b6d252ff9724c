"""Conditional transitions: a late or duplicate report can't complete twice or revive a cancelled job."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import event, select, text, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.store import batches, final_status_effects, job_tallies, jobs, keys, webhooks, workers
from conveyor.core.store.database import make_db_engine, make_session_factory
from conveyor.core.store.jobs import outcomes
from conveyor.core.store.tables import DEFAULT_TENANT, BatchLine, Delivery, Job

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
T1 = T0 + timedelta(seconds=1)
T2 = T0 + timedelta(seconds=2)
OWN_HOOK = {"url": "https://own.example/hook"}


def add_job(
    session: Session, *, ttl_s: float | None = None, queue: str = "interactive", at: datetime = T0,
    tenant: str = DEFAULT_TENANT, webhook: dict[str, Any] | None = None,
) -> str:
    new = jobs.NewJob(
        tenant_id=tenant, queue=queue, prompt="hello", messages=None, params={"max_tokens": 4},
        meta=None, webhook=webhook, idempotency_key=None, request_hash="h", prompt_tokens=2, ttl_s=ttl_s,
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
    counts = job_tallies.queue_counts(session, T0)
    assert counts["interactive"] == job_tallies.QueueCounts(2, 0, T0 + timedelta(seconds=1))
    assert counts["documents"] == job_tallies.QueueCounts(0, 1, None)
    assert jobs.count_queued(session, "interactive") == 2


# --- claim_many ----------------------------------------------------------------------------------------


@contextmanager
def statements(session: Session) -> Iterator[list[str]]:
    """The SQL statements the session's db engine runs inside the block."""
    seen: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        seen.append(statement)

    db_engine = session.get_bind()
    event.listen(db_engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(db_engine, "before_cursor_execute", record)


def events_of(session: Session, job_id: str, tenant: str = DEFAULT_TENANT) -> list[str]:
    return [d.event_type for d in webhooks.for_subject(session, tenant, "job", job_id)]


def in_batch(session: Session, job_ids: list[str]) -> str:
    batch = batches.create(session, tenant_id=DEFAULT_TENANT, input_url="s3://bucket-a/in.jsonl",
                           output_url="s3://bucket-a/out/", queue="interactive", now=T0)
    session.add_all(BatchLine(batch_id=batch.id, line=n, custom_id=f"c-{n}", status="queued", job_id=job_id)
                    for n, job_id in enumerate(job_ids, start=1))
    session.execute(update(Job).where(Job.id.in_(job_ids)).values(batch_id=batch.id))  # as the batch runner
    session.commit()
    return batch.id


def batch_counts(session: Session, batch_id: str) -> tuple[int, int, int, int]:
    row = batches.get(session, batch_id)
    assert row is not None
    return row.completed, row.failed, row.prompt_tokens, row.completion_tokens


def test_claim_many_returns_claimed_rows_in_the_order_asked_from_one_update(session: Session) -> None:
    a, b, c = (add_job(session) for _ in range(3))
    with statements(session) as seen:
        claimed = jobs.claim_many(session, [c, a, b], "w1", T1)
    assert [job.id for job in claimed] == [c, a, b]
    assert {(job.status, job.attempts, job.worker_id, job.started_at) for job in claimed} == {
        ("running", 1, "w1", T1)}
    assert sum(s.lstrip().upper().startswith("UPDATE JOBS") for s in seen) == 1


def test_claim_many_returns_a_job_listed_twice_once(session: Session) -> None:
    a, b = add_job(session), add_job(session)
    assert [job.id for job in jobs.claim_many(session, [a, b, a], "w1", T0)] == [a, b]
    job = jobs.get(session, a)
    assert job is not None and job.attempts == 1


def test_claim_many_leaves_out_jobs_that_are_not_queued(session: Session) -> None:
    running, cancelled, waiting = add_job(session), add_job(session), add_job(session)
    assert jobs.claim(session, running, "w1", T0) is not None
    assert jobs.cancel(session, cancelled, DEFAULT_TENANT, T0) is not None
    claimed = jobs.claim_many(session, [running, cancelled, "job_missing", waiting], "w2", T1)
    assert [job.id for job in claimed] == [waiting]
    held = jobs.get(session, running)
    assert held is not None and (held.worker_id, held.attempts) == ("w1", 1)
    assert jobs.get(session, cancelled).status == "cancelled"  # type: ignore[union-attr]
    assert jobs.claim_many(session, [], "w2", T1) == []


def test_claim_many_expires_overdue_jobs_with_their_follow_on_effects_once(session: Session) -> None:
    overdue = add_job(session, ttl_s=10, webhook=OWN_HOOK)
    fresh = add_job(session, ttl_s=60, webhook=OWN_HOOK)
    batch_id = in_batch(session, [overdue, fresh])
    claimed = jobs.claim_many(session, [overdue, fresh], "w1", T0 + timedelta(seconds=11))
    assert [job.id for job in claimed] == [fresh]
    job = jobs.get(session, overdue)
    assert job is not None and (job.status, job.attempts, job.started_at) == ("expired", 0, None)
    assert jobs.claim_many(session, [overdue], "w2", T0 + timedelta(seconds=12)) == []  # a late duplicate
    assert events_of(session, overdue) == ["job.expired"]
    assert events_of(session, fresh) == []
    assert batch_counts(session, batch_id)[:2] == (0, 1)


# --- record_step ---------------------------------------------------------------------------------------


def done(job_id: str, attempt: int, first_token_at: datetime | None = None) -> jobs.Completion:
    return jobs.Completion(job_id, attempt, "out", "stop", prompt_tokens=2, completion_tokens=3,
                           preemptions=0, first_token_at=first_token_at)


def boom(job_id: str, attempt: int) -> jobs.Failure:
    return jobs.Failure(job_id, attempt, "engine_error", "boom")


def claimed_twice(session: Session, webhook: dict[str, Any] | None = None) -> str:
    """A job whose first attempt's worker died: it now runs as attempt 2, so attempt 1 is stale."""
    job_id = add_job(session, webhook=webhook)
    assert jobs.claim(session, job_id, "dead", T0) is not None
    assert jobs.requeue_orphans(session, ["dead"], T0) == [(job_id, "interactive")]
    again = jobs.claim(session, job_id, "w1", T0)
    assert again is not None and again.attempts == 2
    return job_id


def test_record_step_applies_each_outcome_for_its_own_attempt_in_one_commit(session: Session) -> None:
    ok, bad = add_job(session), add_job(session)
    stale = claimed_twice(session)
    assert len(jobs.claim_many(session, [ok, bad], "w1", T0)) == 2
    commits: list[Session] = []

    def committed(s: Session) -> None:
        commits.append(s)

    event.listen(session, "after_commit", committed)
    made_final = jobs.record_step(session, [], [done(ok, 1), boom(bad, 1), done(stale, 1)], T1)
    event.remove(session, "after_commit", committed)
    assert sorted(made_final) == sorted([ok, bad])
    assert len(commits) == 1
    states = {j: jobs.get(session, j) for j in (ok, bad, stale)}
    assert {j: (row.status, row.result_text, row.error_code) for j, row in states.items() if row} == {
        ok: ("succeeded", "out", None), bad: ("failed", None, "engine_error"), stale: ("running", None, None)}


def test_record_step_runs_follow_on_effects_once_per_status_for_applied_jobs_only(
    session: Session, monkeypatch: pytest.MonkeyPatch,
) -> None:
    ok1, ok2, bad = (add_job(session, webhook=OWN_HOOK) for _ in range(3))
    assert len(jobs.claim_many(session, [ok1, ok2, bad], "w1", T0)) == 3
    stale = claimed_twice(session, webhook=OWN_HOOK)
    batch_id = in_batch(session, [ok1, ok2, bad, stale])
    calls: list[tuple[list[str], str]] = []

    def spy(s: Session, job_ids: list[str], status: str, now: datetime) -> None:
        calls.append((sorted(job_ids), status))
        final_status_effects.record_finished(s, job_ids, status, now)

    monkeypatch.setattr(outcomes, "record_finished", spy)
    # ok1 reported twice in the step, and stale's dead first attempt reporting late
    step: list[jobs.Outcome] = [done(ok1, 1), boom(bad, 1), done(ok2, 1), done(ok1, 1), done(stale, 1)]
    assert sorted(jobs.record_step(session, [], step, T1)) == sorted([ok1, ok2, bad])
    assert sorted(calls) == sorted([(sorted([ok1, ok2]), "succeeded"), ([bad], "failed")])
    assert jobs.record_step(session, [], step, T2) == []  # the whole step replayed changes nothing
    assert [events_of(session, j) for j in (ok1, ok2, bad, stale)] == [
        ["job.succeeded"], ["job.succeeded"], ["job.failed"], []]
    assert batch_counts(session, batch_id) == (2, 1, 2 * 2, 2 * 3)


def test_record_step_makes_a_job_final_once_when_reported_twice_in_two_forms_or_cancelled_first(
    session: Session,
) -> None:
    twice, cancelled, ok = (add_job(session, webhook=OWN_HOOK) for _ in range(3))
    assert len(jobs.claim_many(session, [twice, cancelled, ok], "w1", T0)) == 3
    assert jobs.cancel(session, cancelled, "default", T1) is not None
    session.commit()
    with_logprobs = jobs.Completion(twice, 1, "out", "stop", 2, 3, 0, None, logprobs=[{"token_id": 1}])
    step: list[jobs.Outcome] = [done(twice, 1), with_logprobs, done(cancelled, 1), done(ok, 1)]
    assert sorted(jobs.record_step(session, [], step, T2)) == sorted([twice, ok])
    assert [events_of(session, j) for j in (twice, cancelled, ok)] == [
        ["job.succeeded"], ["job.cancelled"], ["job.succeeded"]]
    assert jobs.get(session, cancelled).status == "cancelled"  # type: ignore[union-attr]


def test_record_step_stores_each_completions_drafted_and_accepted_tokens(session: Session) -> None:
    """Speculative decoding's usage, written by the one statement of the step's completions, row by row."""
    drafted, plain = add_job(session), add_job(session)
    assert len(jobs.claim_many(session, [drafted, plain], "w1", T0)) == 2
    speculated = jobs.Completion(drafted, 1, "out", "stop", prompt_tokens=2, completion_tokens=3,
                                 preemptions=0, first_token_at=None, draft_tokens=12, accepted_draft_tokens=9)
    assert sorted(jobs.record_step(session, [], [speculated, done(plain, 1)], T1)) == sorted([drafted, plain])
    rows = {job_id: jobs.get(session, job_id) for job_id in (drafted, plain)}
    assert {job_id: (row.draft_tokens, row.accepted_draft_tokens) for job_id, row in rows.items() if row} == {
        drafted: (12, 9), plain: (0, 0)}


def test_record_step_records_first_tokens_only_for_the_running_attempt(session: Session) -> None:
    fresh, already, finished, both = (add_job(session) for _ in range(4))
    assert len(jobs.claim_many(session, [fresh, already, finished, both], "w1", T0)) == 4
    stale = claimed_twice(session)
    assert jobs.record_first_token(session, already, 1, T1)
    assert complete(session, finished, 1, at=T1)
    firsts = [jobs.FirstToken(j, 1, T2) for j in (fresh, stale, already, finished, both)]
    later = T2 + timedelta(seconds=1)
    assert jobs.record_step(session, firsts, [done(both, 1, first_token_at=later)], later) == [both]
    first_token_at = {j: jobs.get(session, j).first_token_at for j in (fresh, stale, already, finished, both)}  # type: ignore[union-attr]
    assert first_token_at == {fresh: T2, stale: None, already: T1, finished: T1, both: T2}


def test_a_group_gets_one_delivery_per_matching_enabled_subscription_of_its_tenant(session: Session) -> None:
    for tenant in ("acme", "idle"):
        keys.ensure_tenant(session, tenant, T0)
    session.commit()

    def subscribe(tenant: str, url: str, patterns: list[str]) -> str:
        return webhooks.create_subscription(session, tenant, url, patterns, None, T0)[0].id

    every = subscribe(DEFAULT_TENANT, "https://a.example/every", ["job.*"])
    succeeded = subscribe(DEFAULT_TENANT, "https://a.example/succeeded", ["job.succeeded"])
    subscribe(DEFAULT_TENANT, "https://a.example/failed", ["job.failed"])  # its filter does not match
    disabled = subscribe(DEFAULT_TENANT, "https://a.example/disabled", [])
    webhooks.disable_subscription(session, disabled, "target answered HTTP 410", T0)
    session.commit()
    acme = subscribe("acme", "https://acme.example/all", [])
    subscribe("idle", "https://idle.example/all", [])  # a tenant with no job in the group
    d1, d2, a1 = add_job(session), add_job(session), add_job(session, tenant="acme")
    assert len(jobs.claim_many(session, [d1, d2, a1], "w1", T0)) == 3
    with statements(session) as seen:
        assert len(jobs.record_step(session, [], [done(d1, 1), done(a1, 1), done(d2, 1)], T1)) == 3
    deliveries = session.execute(select(Delivery.subject_id, Delivery.subscription_id, Delivery.tenant_id,
                                        Delivery.event_type)).all()
    assert sorted(tuple(row) for row in deliveries) == sorted([
        (d1, every, DEFAULT_TENANT, "job.succeeded"), (d1, succeeded, DEFAULT_TENANT, "job.succeeded"),
        (d2, every, DEFAULT_TENANT, "job.succeeded"), (d2, succeeded, DEFAULT_TENANT, "job.succeeded"),
        (a1, acme, "acme", "job.succeeded"),
    ])
    assert sum(_reads_subscriptions(s) for s in seen) == 1  # every tenant's, read once


def _reads_subscriptions(statement: str) -> bool:
    """A read of the subscriptions themselves (not the probe for a tenant's, inside another statement)."""
    return statement.lstrip().startswith("SELECT webhook_subscriptions.")


def test_a_group_of_tenants_without_subscriptions_reads_none_claiming_or_finishing(session: Session) -> None:
    keys.ensure_tenant(session, "acme", T0)
    session.commit()
    webhooks.create_subscription(session, "acme", "https://acme.example/started", ["job.started"], None, T0)
    plain, acme = add_job(session), add_job(session, tenant="acme")
    with statements(session) as seen:
        assert [job.id for job in jobs.claim_many(session, [plain], "w1", T0)] == [plain]
        assert jobs.record_step(session, [], [done(plain, 1)], T1) == [plain]
    assert not any(_reads_subscriptions(s) for s in seen)  # the default tenant has none: nothing to read

    with statements(session) as seen:
        assert [job.id for job in jobs.claim_many(session, [acme], "w1", T0)] == [acme]
    assert sum(_reads_subscriptions(s) for s in seen) == 1
    assert events_of(session, acme, "acme") == ["job.started"]


def _frozen_peer_holds(sessions: sessionmaker[Session], job_id: str) -> Session:
    """A transaction that changed the job's row and is left open, as a worker stopped mid-write leaves it."""
    peer = sessions()
    peer.execute(update(Job).where(Job.id == job_id).values(updated_at=T2))
    return peer


def test_reconciler_sweeps_skip_rows_a_frozen_transaction_holds(emptied_postgres: str) -> None:
    """A SIGSTOPped worker's open write held its rows' locks, and requeue_orphans (an UPDATE over all of a
    dead worker's jobs) waited on them until the worker resumed: the other jobs were never requeued."""
    db_engine = make_db_engine(emptied_postgres)
    sessions = make_session_factory(db_engine)
    try:
        with sessions() as session:
            held, free = add_job(session), add_job(session)
            expiring_held, expiring_free = add_job(session, ttl_s=1), add_job(session, ttl_s=1)
            for job_id in (held, free):
                assert jobs.claim(session, job_id, "dead", T0) is not None
        peers = [_frozen_peer_holds(sessions, held), _frozen_peer_holds(sessions, expiring_held)]
        with sessions() as session:
            session.execute(text("SET lock_timeout = '5s'"))  # waiting would fail the test, not hang it
            assert jobs.requeue_orphans(session, ["dead"], T1) == [(free, "interactive")]
            assert jobs.expire_overdue(session, T0 + timedelta(seconds=5)) == [expiring_free]
        for peer in peers:
            peer.rollback()  # the peer resumed (or its connection died): the next round sweeps the rest
            peer.close()
        with sessions() as session:
            assert jobs.requeue_orphans(session, ["dead"], T2) == [(held, "interactive")]
            assert jobs.expire_overdue(session, T0 + timedelta(seconds=5)) == [expiring_held]
    finally:
        db_engine.dispose()


def test_a_dead_workers_idle_transaction_is_ended_so_its_rows_are_swept(emptied_postgres: str) -> None:
    """The paused-worker fault test: the frozen worker's open write (its step's first tokens) held one job's
    row, so every sweep skipped it, and that job stayed `running` until the worker woke."""
    worker_id = "worker-" + "h" * 60 + "-frozen"  # longer than Postgres keeps: matched by its first 63 bytes
    db_engine, worker_engine = make_db_engine(emptied_postgres), make_db_engine(emptied_postgres,
                                                                                 session_name=worker_id)
    sessions = make_session_factory(db_engine)
    try:
        with sessions() as session:
            held = add_job(session)
            assert jobs.claim(session, held, worker_id, T0) is not None
        frozen = _frozen_peer_holds(make_session_factory(worker_engine), held)
        with sessions() as session:
            assert workers.end_idle_transactions(session, ["someone-else"]) == 0
            assert workers.end_idle_transactions(session, [worker_id]) == 1
            session.commit()
        with sessions() as session:
            session.execute(text("SET lock_timeout = '5s'"))
            requeued = jobs.requeue_orphans(session, [worker_id], T1)
            for _ in range(50):  # the server ends the session asynchronously
                if requeued:
                    break
                time.sleep(0.1)
                requeued = jobs.requeue_orphans(session, [worker_id], T1)
            assert requeued == [(held, "interactive")]
        with pytest.raises(OperationalError):  # the worker, woken, finds its session gone and retries
            frozen.commit()
        frozen.close()
    finally:
        db_engine.dispose()
        worker_engine.dispose()


def test_expiry_runs_in_batches_earliest_first_until_every_overdue_job_is_expired(session: Session) -> None:
    overdue = [add_job(session, ttl_s=float(5 - i)) for i in range(5)]  # the last added expires first
    later = add_job(session, ttl_s=600)
    expired = jobs.expire_overdue(session, T0 + timedelta(seconds=60), batch=2)
    assert sorted(expired) == sorted(overdue) and len(expired) == 5
    assert set(expired[:2]) == set(overdue[3:])  # the first batch: the two earliest expiries
    assert {jobs.get(session, job_id).status for job_id in overdue} == {"expired"}  # type: ignore[union-attr]
    assert jobs.get(session, later).status == "queued"  # type: ignore[union-attr]


def test_succeeded_per_minute_counts_each_of_the_last_minutes(session: Session) -> None:
    finished = [T0 + timedelta(seconds=s) for s in (-150, -61, -59, -1, 0)]  # minutes -2, -1, 0, 0, 0
    keys.ensure_tenant(session, "alice", T0)
    session.commit()
    for i, at in enumerate(finished):
        job_id = add_job(session, at=at - timedelta(seconds=1), tenant="alice" if i else DEFAULT_TENANT)
        assert jobs.claim(session, job_id, "w1", at) is not None
        assert complete(session, job_id, 1, at=at)
    assert jobs.succeeded_per_minute(session, "interactive", T0, 3) == [1, 1, 3]
    assert jobs.succeeded_per_minute(session, "interactive", T0, 3, "alice") == [0, 1, 3]
    assert jobs.succeeded_per_minute(session, "documents", T0, 2) == [0, 0]


def test_failures_since_counts_the_failed_and_expired_jobs_by_code(session: Session) -> None:
    keys.ensure_tenant(session, "alice", T0)
    session.commit()
    for at, code, tenant in ((T0 - timedelta(hours=2), "engine_error", DEFAULT_TENANT),
                             (T0, "engine_error", DEFAULT_TENANT), (T0, "engine_error", "alice"),
                             (T0, "timeout", "alice")):
        job_id = add_job(session, at=at, tenant=tenant)
        assert jobs.claim(session, job_id, "w1", at) is not None
        assert jobs.fail(session, job_id, 1, code=code, message="x", now=at)
    expired = add_job(session, ttl_s=1, at=T0 - timedelta(seconds=5))
    assert jobs.expire_overdue(session, T0) == [expired]
    assert jobs.failures_since(session, T0 - timedelta(hours=1)) == [
        ("interactive", "engine_error", 2), ("interactive", "expired", 1), ("interactive", "timeout", 1)]
    assert jobs.failures_since(session, T0 - timedelta(hours=1), "alice") == [
        ("interactive", "engine_error", 1), ("interactive", "timeout", 1)]
