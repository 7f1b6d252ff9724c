"""Job tallies (core/store/job_tallies.py, migration 0016's triggers), on SQLite and PostgreSQL: whatever
moves a job, the tallies match a count of the jobs table, before and after a fold; an aborted change counts
nothing (tests/core/store/test_migrations.py: the migration starts them from the jobs already queued and
running)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from conveyor.core.lifecycle import QUEUED, RUNNING
from conveyor.core.store import job_tallies, jobs, keys
from conveyor.core.store.tables import Job, JobTallyDelta

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)


def _add(session: Session, tenant: str = "a", queue: str = "interactive", *, max_tokens: int | None = 4,
         n: int | None = None, ttl_s: float | None = None) -> str:
    keys.ensure_tenant(session, tenant, T0)
    params = {key: value for key, value in (("max_tokens", max_tokens), ("n", n)) if value is not None}
    new = jobs.NewJob(tenant_id=tenant, queue=queue, prompt="p", messages=None, params=params, meta=None,
                      webhook=None, idempotency_key=None, request_hash="h", prompt_tokens=1, ttl_s=ttl_s,
                      timeout_s=None)
    return jobs.add(session, new, T0).id


def _counted(session: Session, tenant_id: str | None = None) -> dict[str, job_tallies.QueueTally]:
    """What the tallies should say: a count of the jobs table."""
    bound = (func.coalesce(Job.params["max_tokens"].as_integer(), 16)
             * func.coalesce(Job.params["n"].as_integer(), 1))
    query = select(Job.queue, Job.status, func.count(), func.sum(bound)).where(
        Job.status.in_((QUEUED, RUNNING)))
    if tenant_id is not None:
        query = query.where(Job.tenant_id == tenant_id)
    out: dict[str, job_tallies.QueueTally] = {}
    for queue, status, count, total in session.execute(query.group_by(Job.queue, Job.status)):
        tally = out.setdefault(queue, job_tallies.QueueTally())
        setattr(tally, "queued" if status == QUEUED else "running", int(count))
        tally.output_bound += int(total)
    return out


def test_every_move_of_a_job_is_tallied_and_a_fold_changes_nothing(session: Session) -> None:
    queued = [_add(session), _add(session, max_tokens=None), _add(session, "b", n=3),
              _add(session, "b", "documents", max_tokens=100)]
    expiring = _add(session, ttl_s=1.0)
    running = [_add(session, "a", "documents") for _ in range(3)]
    assert len(jobs.claim_many(session, running, "w1", T0)) == 3
    assert jobs.complete(session, running[0], 1, result_text="x", finish_reason="stop", prompt_tokens=1,
                         completion_tokens=1, preemptions=0, first_token_at=T0, now=T0)
    assert jobs.cancel(session, queued[0], "a", T0) is not None
    assert jobs.expire_overdue(session, T0 + timedelta(seconds=5)) == [expiring]
    assert jobs.requeue_orphans(session, ["w1"], T0)  # running -> queued
    session.execute(delete(Job).where(Job.id == queued[1]))  # a queued job deleted
    session.commit()

    expected = _counted(session)
    assert expected["interactive"] == job_tallies.QueueTally(queued=1, running=0, output_bound=3 * 4)
    assert job_tallies.tallies(session) == expected
    assert job_tallies.tallies(session, "b") == _counted(session, "b")
    assert job_tallies.tallies(session, queue="documents") == {"documents": expected["documents"]}
    job_tallies.fold(session)
    assert session.scalar(select(func.count()).select_from(JobTallyDelta)) == 0
    assert job_tallies.tallies(session) == expected
    job_tallies.fold(session)  # nothing to fold
    assert job_tallies.tallies(session) == expected


def test_a_rolled_back_change_counts_nothing(session: Session) -> None:
    job_id, other = _add(session), _add(session)
    session.execute(update(Job).where(Job.id == job_id).values(status=RUNNING))
    session.execute(delete(Job).where(Job.id == other))
    session.rollback()
    assert job_tallies.tallies(session) == {"interactive": job_tallies.QueueTally(2, 0, 8)}


def test_a_read_free_to_fold_folds_many_deltas(session: Session, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(job_tallies, "FOLD_AT", 3)
    for _ in range(3):
        _add(session)
    assert job_tallies.tallies(session) == {"interactive": job_tallies.QueueTally(3, 0, 12)}
    assert session.scalar(select(func.count()).select_from(JobTallyDelta)) == 3  # not free to: left
    assert job_tallies.tallies(session, may_fold=True) == {"interactive": job_tallies.QueueTally(3, 0, 12)}
    assert session.scalar(select(func.count()).select_from(JobTallyDelta)) == 0
    assert job_tallies.tallies(session) == {"interactive": job_tallies.QueueTally(3, 0, 12)}


def test_queue_counts_give_the_oldest_claimable_job_per_queue_and_tenant(session: Session) -> None:
    _add(session, "a")
    keys.ensure_tenant(session, "b", T0)
    session.commit()
    older = jobs.NewJob(tenant_id="b", queue="interactive", prompt="p", messages=None, params={}, meta=None,
                        webhook=None, idempotency_key=None, request_hash="h", prompt_tokens=1, ttl_s=None,
                        timeout_s=None)
    jobs.add(session, older, T0 - timedelta(seconds=30))
    everyone = job_tallies.queue_counts(session, T0)
    assert everyone["interactive"] == job_tallies.QueueCounts(2, 0, T0 - timedelta(seconds=30))
    assert job_tallies.queue_counts(session, T0, "a")["interactive"] == job_tallies.QueueCounts(1, 0, T0)
    assert job_tallies.queue_counts(session, T0, "nobody") == {}
