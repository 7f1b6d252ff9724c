"""The reconciler on Postgres: re-publishes undispatched jobs (broker down, or a crash between commit and
publish), requeues the running jobs of dead workers, expires overdue jobs, and is safe to run concurrently."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.clock import utcnow
from conveyor.core.store import job_tallies, jobs, workers
from conveyor.core.store.tables import Job, Worker
from conveyor.worker.reconciler import Local, Reconciler
from tests.support.service import RecordingPublisher
from tests.support.worker import add_job, get_job, lane


def _age(sessions: sessionmaker[Session], job_id: str, seconds: float) -> None:
    with sessions() as session:
        created = utcnow() - timedelta(seconds=seconds)
        session.execute(update(Job).where(Job.id == job_id).values(created_at=created))
        session.commit()


def _claimed_by(sessions: sessionmaker[Session], job_id: str, worker_id: str, last_seen_ago_s: float) -> None:
    now = utcnow()
    with sessions() as session:
        workers.register(session, worker_id, hostname="h", pid=1, queues=[lane("interactive")], now=now)
        assert jobs.claim(session, job_id, worker_id, now) is not None
        session.execute(update(Worker).where(Worker.id == worker_id)
                        .values(last_seen_at=now - timedelta(seconds=last_seen_ago_s)))
        session.commit()


def test_undispatched_jobs_are_published_once_the_broker_is_back(
    sessions: sessionmaker[Session], make_settings: Callable[..., Any], pg_url: str
) -> None:
    settings = make_settings(database_url=pg_url, dispatch_grace_s=5.0)
    old, young = add_job(sessions, "old"), add_job(sessions, "young")
    _age(sessions, old, 60)
    broker = RecordingPublisher(reachable=False)
    reconciler = Reconciler(sessions, broker, settings)

    assert reconciler.run_once().published == 0
    assert get_job(sessions, old).dispatched_at is None

    broker.reachable = True
    assert reconciler.run_once().published == 1
    assert broker.published == [(old, lane("interactive"))]  # the young job is still within the API's grace
    assert get_job(sessions, young).dispatched_at is None
    assert get_job(sessions, old).dispatched_at is not None
    assert reconciler.run_once().published == 0  # dispatched jobs are not published again


def test_running_jobs_of_dead_workers_are_requeued_and_republished(
    sessions: sessionmaker[Session], make_settings: Callable[..., Any], pg_url: str
) -> None:
    settings = make_settings(database_url=pg_url, worker_dead_after_s=2.0)
    orphan, alive = add_job(sessions, "orphan"), add_job(sessions, "alive")
    _claimed_by(sessions, orphan, "dead-worker", last_seen_ago_s=30)
    _claimed_by(sessions, alive, "live-worker", last_seen_ago_s=0)
    broker = RecordingPublisher()

    report = Reconciler(sessions, broker, settings).run_once()

    assert report.requeued == 1
    assert broker.published == [(orphan, lane("interactive"))]
    job = get_job(sessions, orphan)
    assert job.status == "queued" and job.worker_id is None and job.attempts == 1
    assert get_job(sessions, alive).status == "running"


def test_overdue_queued_jobs_expire(
    sessions: sessionmaker[Session], make_settings: Callable[..., Any], pg_url: str
) -> None:
    settings = make_settings(database_url=pg_url)
    job_id = add_job(sessions, "late", ttl_s=0.001)

    report = Reconciler(sessions, RecordingPublisher(), settings).run_once()

    assert report.expired == 1
    assert get_job(sessions, job_id).status == "expired"


def test_concurrent_reconcilers_requeue_each_orphan_once(
    sessions: sessionmaker[Session], make_settings: Callable[..., Any], pg_url: str
) -> None:
    settings = make_settings(database_url=pg_url, worker_dead_after_s=2.0)
    orphans = [add_job(sessions, f"orphan {i}") for i in range(5)]
    for job_id in orphans:
        _claimed_by(sessions, job_id, "dead-worker", last_seen_ago_s=30)
    reconcilers = [Reconciler(sessions, RecordingPublisher(), settings) for _ in range(4)]

    with ThreadPoolExecutor(4) as pool:
        reports = list(pool.map(lambda r: r.run_once(), reconcilers))

    assert sum(r.requeued for r in reports) == len(orphans)
    assert all(get_job(sessions, j).status == "queued" for j in orphans)


def test_queued_jobs_whose_messages_the_broker_lost_are_published_again(
    sessions: sessionmaker[Session], make_settings: Callable[..., Any], pg_url: str
) -> None:
    settings = make_settings(database_url=pg_url, dispatch_grace_s=0.5)
    lost, recent = add_job(sessions, "lost"), add_job(sessions, "recent")
    with sessions() as session:
        jobs.mark_dispatched(session, [lost], utcnow() - timedelta(seconds=60))
        jobs.mark_dispatched(session, [recent], utcnow())
    broker = RecordingPublisher()
    broker.waiting = 3  # messages still in the broker's queue: nothing is known to be lost

    assert Reconciler(sessions, broker, settings).run_once().redispatched == 0

    broker.waiting = 0  # the queue is empty, yet the store has a job queued and dispatched long ago
    assert Reconciler(sessions, broker, settings).run_once().redispatched == 1
    assert broker.published == [(lost, lane("interactive"))]
    assert Reconciler(sessions, broker, settings).run_once().redispatched == 0  # dispatched just now


def test_after_the_broker_lost_its_queues_every_dispatched_job_goes_out_again_in_order_however_busy(
    sessions: sessionmaker[Session], make_settings: Callable[..., Any], pg_url: str
) -> None:
    settings = make_settings(database_url=pg_url, dispatch_grace_s=0.5)
    backlog = [add_job(sessions, f"backlog {i}") for i in range(3)]
    with sessions() as session:
        jobs.mark_dispatched(session, backlog, utcnow() - timedelta(seconds=1))
    broker = RecordingPublisher()
    broker.waiting = 50  # new traffic keeps the broker's queue from ever being empty
    reconciler = Reconciler(sessions, broker, settings)
    assert reconciler.run_once().redispatched == 0

    broker.restarted = True  # Redis came back without its data
    assert reconciler.run_once().redispatched == 3
    assert broker.published == [(job_id, lane("interactive")) for job_id in backlog]  # oldest first
    assert reconciler.run_once().redispatched == 0  # once


def test_a_broker_that_fails_half_way_through_the_republish_is_resumed_next_round(
    sessions: sessionmaker[Session], make_settings: Callable[..., Any], pg_url: str
) -> None:
    settings = make_settings(database_url=pg_url, dispatch_grace_s=0.5)
    backlog = [add_job(sessions, f"backlog {i}") for i in range(2)]
    with sessions() as session:
        jobs.mark_dispatched(session, backlog, utcnow() - timedelta(seconds=1))
    broker = RecordingPublisher()
    broker.restarted, broker.waiting = True, 50
    reconciler = Reconciler(sessions, broker, settings)
    original = broker.publish

    def fail_after_the_first(job_id: str, queue: str) -> None:
        if broker.published:
            raise ConnectionError("broker: gone again")
        original(job_id, queue)

    broker.publish = fail_after_the_first  # type: ignore[method-assign]
    assert reconciler.run_once().redispatched == 1
    broker.publish = original  # type: ignore[method-assign]
    assert reconciler.run_once().redispatched == 1  # the rest, though lost_messages() said so only once
    assert broker.published == [(job_id, lane("interactive")) for job_id in backlog]


def test_a_worker_never_requeues_its_own_jobs_however_late_its_heartbeat(
    sessions: sessionmaker[Session], make_settings: Callable[..., Any], pg_url: str
) -> None:
    settings = make_settings(database_url=pg_url, worker_dead_after_s=2.0)
    job_id = add_job(sessions, "mine")
    _claimed_by(sessions, job_id, "paused-worker", last_seen_ago_s=30)  # its heartbeat could not be written

    itself = Reconciler(sessions, RecordingPublisher(), settings,
                        Local("paused-worker", held=lambda: {(job_id, 1)}))
    assert itself.run_once().requeued == 0
    assert get_job(sessions, job_id).status == "running"

    another = Reconciler(sessions, RecordingPublisher(), settings, Local("other-worker", held=set))
    assert another.run_once().requeued == 1  # from outside, silence is all there is to go on


def test_a_claim_this_worker_never_started_is_requeued_by_its_own_reconciler(
    sessions: sessionmaker[Session], make_settings: Callable[..., Any], pg_url: str
) -> None:
    settings = make_settings(database_url=pg_url, dispatch_grace_s=1.0)
    lost, held, young = (add_job(sessions, name) for name in ("lost", "held", "young"))
    for job_id in (lost, held, young):
        _claimed_by(sessions, job_id, "me", last_seen_ago_s=0)
    with sessions() as session:  # the claim's answer never reached the runner; the connection dropped
        session.execute(update(Job).where(Job.id.in_([lost, held]))
                        .values(started_at=utcnow() - timedelta(seconds=30)))
        session.commit()
    broker = RecordingPublisher()

    report = Reconciler(sessions, broker, settings, Local("me", held=lambda: {(held, 1)})).run_once()

    assert report.requeued == 1 and broker.published == [(lost, lane("interactive"))]
    requeued = get_job(sessions, lost)
    assert (requeued.status, requeued.attempts) == ("queued", 0)  # the claim given back: it never ran
    assert get_job(sessions, held).status == "running"  # the runner has it
    assert get_job(sessions, young).status == "running"  # a claim may still be on its way to the runner


def test_a_stopping_worker_leaves_its_claims_to_its_runner_which_counts_the_attempts_that_ran(
    sessions: sessionmaker[Session], make_settings: Callable[..., Any], pg_url: str
) -> None:
    """At shutdown the runner aborts its attempts (they leave `held`) and then requeues its own jobs whole,
    attempt counted. A reconciler round in between took them as claims never started and gave the attempt
    back: the job then ran on the next worker as its first attempt (the scale-from-zero fault test saw
    attempts 1, not 2)."""
    settings = make_settings(database_url=pg_url, dispatch_grace_s=1.0)
    ran = add_job(sessions, "ran here")
    _claimed_by(sessions, ran, "me", last_seen_ago_s=0)
    with sessions() as session:
        session.execute(update(Job).where(Job.id == ran).values(started_at=utcnow() - timedelta(seconds=30)))
        session.commit()

    local = Local("me", held=set, stopping=lambda: True)
    report = Reconciler(sessions, RecordingPublisher(), settings, local).run_once()

    assert report.requeued == 0
    job = get_job(sessions, ran)
    assert (job.status, job.attempts, job.worker_id) == ("running", 1, "me")


def test_a_claim_still_on_its_way_to_the_runner_is_left_alone_however_long_it_takes(
    sessions: sessionmaker[Session], make_settings: Callable[..., Any], pg_url: str
) -> None:
    """The runner stalled between the claim's commit and putting the attempt in flight (a busy machine, a
    slow store) for longer than dispatch_grace_s: the jobs that claim took are not this reconciler's to
    requeue, while one claimed before that claim began and never held is."""
    settings = make_settings(database_url=pg_url, dispatch_grace_s=1.0)
    lost, on_the_way = (add_job(sessions, name) for name in ("lost", "on-the-way"))
    claim_began = utcnow() - timedelta(seconds=20)
    for job_id, started_ago_s in ((lost, 30), (on_the_way, 19)):
        _claimed_by(sessions, job_id, "me", last_seen_ago_s=0)
        with sessions() as session:
            session.execute(update(Job).where(Job.id == job_id)
                            .values(started_at=utcnow() - timedelta(seconds=started_ago_s)))
            session.commit()
    broker = RecordingPublisher()

    local = Local("me", held=set, claims_since=lambda: claim_began)
    report = Reconciler(sessions, broker, settings, local).run_once()

    assert report.requeued == 1 and broker.published == [(lost, lane("interactive"))]
    assert get_job(sessions, on_the_way).status == "running"


def test_jobs_queued_by_a_release_before_lanes_move_to_the_default_models_lane_with_their_tally(
    sessions: sessionmaker[Session], make_settings: Callable[..., Any], pg_url: str
) -> None:
    """A rolling upgrade past migration 0017: an API of the previous release still queues under the bare
    queue name, which no worker of the new release takes; the reconciler moves such jobs to the default
    model's lane and publishes them there, their tally with them."""
    settings = make_settings(database_url=pg_url)
    with sessions() as session:  # as the previous release's API inserts it: under the queue's bare name
        old_release = jobs.add(session, jobs.NewJob(
            tenant_id="default", queue="interactive", prompt="old", messages=None,
            params={"max_tokens": 5, "n": 2}, meta=None, webhook=None, idempotency_key=None,
            request_hash="h", prompt_tokens=1, ttl_s=None, timeout_s=None), utcnow()).id
        assert job_tallies.tallies(session, may_fold=True)["interactive"].queued == 1
    broker = RecordingPublisher()
    report = Reconciler(sessions, broker, settings).run_once()
    assert report.requeued == 1 and broker.published == [(old_release, lane("interactive"))]
    with sessions() as session:
        tallied = job_tallies.tallies(session, may_fold=True)
    assert tallied[lane("interactive")] == job_tallies.QueueTally(1, 0, 10)
    assert tallied.get("interactive", job_tallies.QueueTally()) == job_tallies.QueueTally()
    assert Reconciler(sessions, broker, settings).run_once().requeued == 0
