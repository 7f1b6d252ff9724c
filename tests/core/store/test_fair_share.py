"""Fair share inside a queue: the plan (who gets the next slots) and the claim on the store (SQLite and
PostgreSQL): round-robin by tenant weighted by running jobs, a tenant's max_running never passed, batches
of one tenant taking turns, and every job claimed exactly once by concurrent claimers."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session

from conveyor.core.store import batches, jobs, keys, tenants, webhooks
from conveyor.core.store.database import make_db_engine, make_session_factory
from conveyor.core.store.fair_share import FairState, ServedOrder, Share, Stream, StreamLoad, claim_fair, plan
from conveyor.core.store.tables import Job
from conveyor.core.store.tenants import TenantLimits

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)


def at_t0() -> datetime:
    """The claims' clock in these tests."""
    return T0
DEFAULTS = TenantLimits()
A, B = Stream("a", None), Stream("b", None)


def _load(queued: int, running: int = 0, age_s: float = 0.0) -> StreamLoad:
    return StreamLoad(queued, running, T0 - timedelta(seconds=age_s))


def _share(weight: float = 1.0, max_running: int | None = None) -> Share:
    return Share(weight, max_running)


# --- the plan ----------------------------------------------------------------------------------------


def test_a_tenant_that_arrives_later_gets_the_freed_slots_until_it_catches_up() -> None:
    loads = {A: _load(58, running=1, age_s=10), B: _load(4)}  # a's other job just ended
    picks = plan(loads, {"a": _share(), "b": _share()}, 3, ServedOrder())
    assert picks == [B, A, B]  # b first (it runs nothing), then turns


def test_one_free_slot_goes_round_robin() -> None:
    served = ServedOrder()
    loads = {A: _load(50, age_s=10), B: _load(50)}
    shares = {"a": _share(), "b": _share()}
    picks = []
    for _ in range(4):  # nothing runs when each slot frees
        [pick] = plan(loads, shares, 1, served)
        served.note(pick.tenant_id)
        picks.append(pick)
    assert picks == [A, B, A, B]


def test_running_jobs_follow_the_weights() -> None:
    loads = {A: _load(50, age_s=10), B: _load(50)}
    picks = plan(loads, {"a": _share(weight=3.0), "b": _share()}, 8, ServedOrder())
    assert picks.count(A) == 6 and picks.count(B) == 2


def test_a_tenant_at_its_max_running_gets_nothing_more() -> None:
    loads = {A: _load(50, running=2, age_s=10), B: _load(1)}
    picks = plan(loads, {"a": _share(max_running=3), "b": _share()}, 5, ServedOrder())
    assert picks == [B, A]  # one more for a (3), one for b; then nobody may start


def test_batches_of_one_tenant_take_turns() -> None:
    first, second = Stream("a", "batch_1"), Stream("a", "batch_2")
    loads = {first: _load(60, age_s=10), second: _load(60), A: _load(2, age_s=5)}
    picks = plan(loads, {"a": _share()}, 6, ServedOrder())
    assert sorted(picks.count(s) for s in (first, second, A)) == [2, 2, 2]


# --- the claim on the store ------------------------------------------------------------------------


def _add(session: Session, tenant: str, n: int, at: datetime, batch_id: str | None = None,
         queue: str = "documents", meta: dict[str, Any] | None = None) -> list[str]:
    keys.ensure_tenant(session, tenant, T0)
    session.commit()
    new = jobs.NewJob(tenant_id=tenant, queue=queue, prompt="p", messages=None, params={"max_tokens": 1},
                      meta=meta, webhook=None, idempotency_key=None, request_hash="h", prompt_tokens=1,
                      ttl_s=None, timeout_s=None, batch_id=batch_id)
    return [jobs.add(session, new, at + timedelta(milliseconds=i)).id for i in range(n)]


def _batch(session: Session, tenant: str) -> str:
    return batches.create(session, tenant_id=tenant, input_url="s3://b/in.jsonl", output_url="s3://b/out/",
                          queue="documents", now=T0).id


def _finish(session: Session, claimed: list[Job]) -> None:
    for job in claimed:
        assert jobs.complete(session, job.id, job.attempts, result_text="x", finish_reason="stop",
                             prompt_tokens=1, completion_tokens=1, preemptions=0, first_token_at=None, now=T0)


def test_b_submitting_later_runs_before_most_of_a_with_two_slots(session: Session) -> None:
    a_jobs = _add(session, "a", 20, T0)
    state = FairState(view_s=0.0)  # every claim reads the queue afresh: b's jobs are seen at once
    running = claim_fair(session, "documents", 2, "w1", at_t0, DEFAULTS, state)
    assert [j.id for j in running] == a_jobs[:2]  # alone, a's oldest first
    b_jobs = set(_add(session, "b", 4, T0 + timedelta(seconds=1)))
    order: list[str] = []
    while running:  # one slot frees at a time, as jobs end
        done, running = running[0], running[1:]
        _finish(session, [done])
        order.append(done.tenant_id)
        running += claim_fair(session, "documents", 1, "w1", at_t0, DEFAULTS, state)
    assert order[:2] == ["a", "a"]
    last_b = max(i for i, tenant in enumerate(order) if tenant == "b")
    assert last_b < 10, order  # b's 4 jobs done within a's first 6 or so, not after a's 20
    assert order.count("b") == len(b_jobs) and order.count("a") == 20


def test_a_tenants_max_running_holds_and_the_others_take_the_rest(session: Session) -> None:
    _add(session, "a", 10, T0)
    _add(session, "b", 10, T0 + timedelta(seconds=1))
    tenants.set_overrides(session, "a", {"max_running": 2}, T0)
    claimed = claim_fair(session, "documents", 6, "w1", at_t0, DEFAULTS, FairState())
    assert sorted(j.tenant_id for j in claimed) == ["a", "a", "b", "b", "b", "b"]
    assert claim_fair(session, "documents", 6, "w1", at_t0, TenantLimits(max_running=4), FairState()) == []


def test_a_job_whose_metadata_names_a_batch_is_one_of_its_tenants_own_submissions(session: Session) -> None:
    """Only the batch runner's batch_id column makes a stream: a client's metadata is just metadata."""
    own = _add(session, "a", 3, T0)
    claims_a_batch = _add(session, "a", 3, T0 + timedelta(seconds=1), meta={"batch_id": "x"})
    claimed = claim_fair(session, "documents", 3, "w1", at_t0, DEFAULTS, FairState(view_s=0.0))
    assert [job.id for job in claimed] == own  # one stream: oldest first, no turn for "batch" x
    assert all(job.batch_id is None for job in claimed)
    later = claim_fair(session, "documents", 3, "w1", at_t0, DEFAULTS, FairState(view_s=0.0))
    assert [job.id for job in later] == claims_a_batch and all(job.batch_id is None for job in later)
    stored = jobs.get(session, later[0].id)
    assert stored is not None and stored.meta == {"batch_id": "x"}


def test_a_real_batch_of_the_tenant_takes_turns_with_its_own_submissions(session: Session) -> None:
    own = _add(session, "a", 3, T0)
    batch_id = _batch(session, "a")
    lines = _add(session, "a", 3, T0 + timedelta(seconds=1), batch_id=batch_id)
    claimed = claim_fair(session, "documents", 2, "w1", at_t0, DEFAULTS, FairState(view_s=0.0))
    assert sorted(job.id for job in claimed) == sorted([own[0], lines[0]])
    assert {job.batch_id for job in claimed} == {None, batch_id}


def test_expired_and_other_queues_jobs_are_not_claimed(session: Session) -> None:
    _add(session, "a", 1, T0, queue="interactive")
    new = jobs.NewJob(tenant_id="a", queue="documents", prompt="p", messages=None, params={}, meta=None,
                      webhook=None, idempotency_key=None, request_hash="h", prompt_tokens=1, ttl_s=1.0,
                      timeout_s=None)
    jobs.add(session, new, T0)
    two_s_later = T0 + timedelta(seconds=2)
    assert claim_fair(session, "documents", 5, "w1", lambda: two_s_later, DEFAULTS, FairState()) == []


def test_concurrent_claimers_take_each_job_once_and_keep_the_cap(emptied_postgres: str) -> None:
    """PostgreSQL, where worker processes claim at once (embedded SQLite has one claimer per queue)."""
    db_engine = make_db_engine(emptied_postgres)
    session_factory = make_session_factory(db_engine)
    with session_factory() as session:
        ids = set(_add(session, "a", 30, T0)) | set(_add(session, "b", 30, T0))
        tenants.set_overrides(session, "a", {"max_running": 5}, T0)
    claimed: list[Job] = []
    lock = threading.Lock()

    def claimer(worker: str) -> None:
        state = FairState()
        for _ in range(10):
            with session_factory() as own:
                got = claim_fair(own, "documents", 2, worker, at_t0, DEFAULTS, state)
            with lock:
                claimed.extend(got)

    threads = [threading.Thread(target=claimer, args=(f"w{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    db_engine.dispose()

    claimed_ids = [j.id for j in claimed]
    assert len(claimed_ids) == len(set(claimed_ids)) and set(claimed_ids) <= ids
    assert sum(1 for j in claimed if j.tenant_id == "a") == 5  # never past its cap
    assert sum(1 for j in claimed if j.tenant_id == "b") == 30


def test_a_reused_view_of_the_queue_never_leaves_claimable_jobs_behind(session: Session) -> None:
    _add(session, "a", 2, T0)
    one, other = FairState(view_s=3600.0), FairState(view_s=3600.0)
    assert [j.tenant_id for j in claim_fair(session, "documents", 1, "w1", at_t0, DEFAULTS, one)] == ["a"]
    assert len(claim_fair(session, "documents", 5, "w2", at_t0, DEFAULTS, other)) == 1  # a's last job
    b_jobs = set(_add(session, "b", 1, T0 + timedelta(seconds=1)))  # unseen by w1's view, which says a has 1

    claimed = claim_fair(session, "documents", 1, "w1", at_t0, DEFAULTS, one)

    assert {j.id for j in claimed} == b_jobs  # the view came up short: the queue was read again


def _add_urgent(session: Session, at: datetime, *, priority: int = 0, deadline_s: float | None = None,
                start_by: datetime | None = None) -> str:
    keys.ensure_tenant(session, "a", T0)
    session.commit()
    new = jobs.NewJob(tenant_id="a", queue="documents", prompt="p", messages=None, params={"max_tokens": 1},
                      meta=None, webhook=None, idempotency_key=None, request_hash="h", prompt_tokens=1,
                      ttl_s=None, timeout_s=None, priority=priority, deadline_s=deadline_s, start_by=start_by)
    return jobs.add(session, new, at).id


def test_the_job_with_the_least_slack_goes_first_not_the_earliest_deadline(session: Session) -> None:
    # Due at T0+60 but runs 5 s: may start until T0+55. Due later, at T0+90, but runs 80 s: until T0+10.
    short = _add_urgent(session, T0, deadline_s=60.0, start_by=T0 + timedelta(seconds=55))
    long = _add_urgent(session, T0 + timedelta(seconds=1), deadline_s=89.0,
                       start_by=T0 + timedelta(seconds=10))
    order = []
    for _ in range(2):
        [job] = claim_fair(session, "documents", 1, "w1", at_t0, DEFAULTS, FairState(view_s=0.0))
        order.append(job.id)
        _finish(session, [job])
    assert order == [long, short]


def test_a_stream_is_claimed_by_priority_then_a_deadline_ahead_then_arrival(session: Session) -> None:
    plain = _add_urgent(session, T0)
    missed = _add_urgent(session, T0 + timedelta(seconds=1), deadline_s=2.0)  # passed by the claim at T0+10
    later = _add_urgent(session, T0 + timedelta(seconds=2), deadline_s=3600.0)
    soon = _add_urgent(session, T0 + timedelta(seconds=3), deadline_s=60.0)
    urgent = _add_urgent(session, T0 + timedelta(seconds=4), priority=-1)
    background = _add_urgent(session, T0 + timedelta(seconds=5), priority=5, deadline_s=20.0)
    ten_s_later = T0 + timedelta(seconds=10)
    order = []
    for _ in range(6):
        [job] = claim_fair(session, "documents", 1, "w1", lambda: ten_s_later, DEFAULTS,
                           FairState(view_s=0.0))
        order.append(job.id)
        _finish(session, [job])
    assert order == [urgent, soon, later, plain, missed, background]


def test_claims_by_arrival_ignore_priority_and_deadline(session: Session) -> None:
    plain = _add_urgent(session, T0)
    urgent = _add_urgent(session, T0 + timedelta(seconds=1), priority=-1, deadline_s=5.0)
    claimed = claim_fair(session, "documents", 1, "w1", at_t0, DEFAULTS, FairState(view_s=0.0),
                         by_arrival=True)
    assert [job.id for job in claimed] == [plain] and urgent != plain


def test_a_tenant_claimed_out_of_a_reused_view_is_still_planned_when_the_queue_is_read_again(
        session: Session) -> None:
    """b's only job is claimed from the reused view, a's planned job is gone (cancelled), so the claim reads
    the queue again: b no longer queues anything but now runs one, and the plan still knows b's share."""
    a_jobs = _add(session, "a", 2, T0)
    _add(session, "b", 1, T0 + timedelta(seconds=1))
    state = FairState(view_s=3600.0)
    assert [j.id for j in claim_fair(session, "documents", 1, "w1", at_t0, DEFAULTS, state)] == a_jobs[:1]
    jobs.cancel(session, a_jobs[1], "a", T0)

    claimed = claim_fair(session, "documents", 2, "w1", at_t0, DEFAULTS, state)

    assert [j.tenant_id for j in claimed] == ["b"]


def _add_wide(session: Session, tenant: str, n: int, choices: int, at: datetime) -> list[str]:
    keys.ensure_tenant(session, tenant, T0)
    session.commit()
    new = jobs.NewJob(tenant_id=tenant, queue="documents", prompt="p", messages=None,
                      params={"max_tokens": 1, "n": choices}, meta=None, webhook=None, idempotency_key=None,
                      request_hash="h", prompt_tokens=1, ttl_s=None, timeout_s=None)
    return [jobs.add(session, new, at + timedelta(milliseconds=i)).id for i in range(n)]


def test_a_claim_counts_sequences_a_job_of_many_choices_takes_as_many_places(session: Session) -> None:
    """A's jobs of 4 choices each run 4 sequences: a claim of 4 places takes one of them, not four (16
    sequences), and B, running nothing, then gets the next 4 places before A another job."""
    wide = _add_wide(session, "a", 3, 4, T0)
    b_jobs = _add(session, "b", 6, T0 + timedelta(seconds=1))
    state = FairState(view_s=0.0)

    assert [j.id for j in claim_fair(session, "documents", 4, "w1", at_t0, DEFAULTS, state)] == wide[:1]
    assert [j.id for j in claim_fair(session, "documents", 4, "w1", at_t0, DEFAULTS, state)] == b_jobs[:4]
    left = jobs.get(session, wide[1])
    assert left is not None and (left.status, left.attempts, left.worker_id) == ("queued", 0, None)


def test_a_job_wider_than_the_room_is_claimed_alone_when_the_room_is_whole(session: Session) -> None:
    wide = _add_wide(session, "a", 2, 8, T0)
    state = FairState(view_s=0.0)
    assert [j.id for j in claim_fair(session, "documents", 4, "w1", at_t0, DEFAULTS, state)] == wide[:1]


def test_a_claim_returns_each_tenants_cache_namespace_and_reads_subscriptions_only_where_there_are_some(
    session: Session,
) -> None:
    [a_job], b_jobs = _add(session, "a", 1, T0), _add(session, "b", 2, T0 + timedelta(seconds=1))
    webhooks.create_subscription(session, "a", "https://a.example/hook", ["job.started"], None, T0)
    tenants.set_overrides(session, "b", {"cache_namespace": "shared"}, T0)
    seen: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        seen.append(statement)

    def subscription_reads() -> int:
        return sum(statement.lstrip().startswith("SELECT webhook_subscriptions.") for statement in seen)

    event.listen(session.get_bind(), "before_cursor_execute", record)
    try:
        claimed = claim_fair(session, "documents", 2, "w1", at_t0, DEFAULTS, FairState(view_s=0.0))
        assert {job.id: (job.cache_namespace, job.subscribed) for job in claimed} == {
            a_job: (None, True), b_jobs[0]: ("shared", False)}
        assert subscription_reads() == 1  # a's, for its job.started
        seen.clear()
        assert [job.id for job in claim_fair(session, "documents", 1, "w1", at_t0, DEFAULTS,
                                             FairState(view_s=0.0))] == b_jobs[1:]
        assert subscription_reads() == 0  # b has none: nothing to read
    finally:
        event.remove(session.get_bind(), "before_cursor_execute", record)
    assert [d.event_type for d in webhooks.for_subject(session, "a", "job", a_job)] == ["job.started"]
    assert webhooks.for_subject(session, "b", "job", b_jobs[0]) == []
