"""DispatchRelay: committed jobs are published from the relay's own thread and marked dispatched in groups;
what the broker refuses stays undispatched (dispatched_at NULL) for the reconciler."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone

import pytest
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.seams.dispatch import DispatchRelay
from conveyor.core.store import jobs
from conveyor.core.store.tables import DEFAULT_TENANT

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
WAIT_S = 10.0


class Broker:
    """A publish callable that records what it got; it can hold its first call until released, and refuse
    chosen jobs."""

    def __init__(self, *, hold_first: bool = False, refuse: frozenset[str] = frozenset()) -> None:
        self.published: list[tuple[str, str]] = []
        self.first_call = threading.Event()
        self.release = threading.Event()
        if not hold_first:
            self.release.set()
        self._refuse = refuse

    def __call__(self, job_id: str, queue: str) -> None:
        self.first_call.set()
        assert self.release.wait(WAIT_S)
        if job_id in self._refuse:
            raise ConnectionError("broker down")
        self.published.append((job_id, queue))


@pytest.fixture
def relays() -> Iterator[Callable[[sessionmaker[Session], Broker], DispatchRelay]]:
    made: list[tuple[DispatchRelay, Broker]] = []

    def make(sessions: sessionmaker[Session], broker: Broker) -> DispatchRelay:
        relay = DispatchRelay(sessions, broker)
        made.append((relay, broker))
        return relay

    yield make
    for relay, broker in made:
        broker.release.set()
        relay.stop()


def add_jobs(sessions: sessionmaker[Session], n: int, queue: str = "interactive") -> list[str]:
    new = jobs.NewJob(
        tenant_id=DEFAULT_TENANT, queue=queue, prompt="hello", messages=None, params={}, meta=None,
        webhook=None, idempotency_key=None, request_hash="h", prompt_tokens=1, ttl_s=None, timeout_s=None,
    )
    with sessions() as session:
        return [jobs.add(session, new, T0).id for _ in range(n)]


def dispatched(sessions: sessionmaker[Session], job_ids: list[str]) -> dict[str, bool]:
    with sessions() as session:
        return {job_id: jobs.get(session, job_id).dispatched_at is not None  # type: ignore[union-attr]
                for job_id in job_ids}


def wait_dispatched(sessions: sessionmaker[Session], job_ids: list[str]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not all(dispatched(sessions, job_ids).values()):
        assert time.monotonic() < deadline, f"not marked dispatched: {dispatched(sessions, job_ids)}"
        time.sleep(0.01)


def test_dispatched_jobs_are_published_and_marked(
    session_factory: sessionmaker[Session], relays: Callable[[sessionmaker[Session], Broker], DispatchRelay],
) -> None:
    broker = Broker()
    relay = relays(session_factory, broker)
    first = add_jobs(session_factory, 2)
    last = add_jobs(session_factory, 1, queue="documents")
    for job_id in first:
        relay.dispatch(job_id, "interactive")
    relay.dispatch(last[0], "documents")
    wait_dispatched(session_factory, first + last)
    assert broker.published == [(first[0], "interactive"), (first[1], "interactive"), (last[0], "documents")]


def test_jobs_that_pile_up_are_marked_in_one_update_per_group(
    session_factory: sessionmaker[Session], relays: Callable[[sessionmaker[Session], Broker], DispatchRelay],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    marks: list[int] = []
    mark_dispatched = jobs.mark_dispatched

    def counting(session: Session, job_ids: list[str], now: datetime) -> None:
        marks.append(len(job_ids))
        mark_dispatched(session, job_ids, now)

    monkeypatch.setattr(jobs, "mark_dispatched", counting)
    broker = Broker(hold_first=True)
    relay = relays(session_factory, broker)
    job_ids = add_jobs(session_factory, 50)
    relay.dispatch(job_ids[0], "interactive")
    assert broker.first_call.wait(WAIT_S)
    for job_id in job_ids[1:]:
        relay.dispatch(job_id, "interactive")  # the relay is busy with the first: these pile up
    broker.release.set()
    wait_dispatched(session_factory, job_ids)
    assert marks == [1, 49]
    assert [job_id for job_id, _ in broker.published] == job_ids


def test_a_refused_publish_leaves_that_job_and_the_rest_of_its_group_undispatched(
    session_factory: sessionmaker[Session], relays: Callable[[sessionmaker[Session], Broker], DispatchRelay],
) -> None:
    gate, sent, refused, unsent, later = add_jobs(session_factory, 5)
    broker = Broker(hold_first=True, refuse=frozenset({refused}))
    relay = relays(session_factory, broker)
    relay.dispatch(gate, "interactive")
    assert broker.first_call.wait(WAIT_S)
    for job_id in (sent, refused, unsent):  # one group, behind the held first publish
        relay.dispatch(job_id, "interactive")
    broker.release.set()
    wait_dispatched(session_factory, [gate, sent])  # the group is done: its published part is marked
    relay.dispatch(later, "interactive")  # and a later group still goes out
    wait_dispatched(session_factory, [later])
    assert dispatched(session_factory, [refused, unsent]) == {refused: False, unsent: False}
    with session_factory() as session:
        left = jobs.undispatched(session, datetime(2100, 1, 1, tzinfo=timezone.utc))
    assert sorted(left) == sorted([(refused, "interactive"), (unsent, "interactive")])


def test_stop_publishes_what_was_already_waiting(
    session_factory: sessionmaker[Session], relays: Callable[[sessionmaker[Session], Broker], DispatchRelay],
) -> None:
    job_ids = add_jobs(session_factory, 4)
    broker = Broker(hold_first=True)
    relay = relays(session_factory, broker)
    relay.dispatch(job_ids[0], "interactive")
    assert broker.first_call.wait(WAIT_S)
    for job_id in job_ids[1:]:
        relay.dispatch(job_id, "interactive")
    releaser = threading.Timer(0.05, broker.release.set)  # after stop() has queued its marker
    releaser.start()
    relay.stop(timeout_s=WAIT_S)
    releaser.join()
    assert [job_id for job_id, _ in broker.published] == job_ids
    assert all(dispatched(session_factory, job_ids).values())  # no waiting: stop() returned after the marks


def test_an_unused_relay_starts_no_thread_and_stops_at_once(
    session_factory: sessionmaker[Session], relays: Callable[[sessionmaker[Session], Broker], DispatchRelay],
) -> None:
    def relay_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "dispatch-relay"}

    before = relay_threads()
    relay = relays(session_factory, Broker(hold_first=True))
    assert relay_threads() == before
    errors: list[BaseException] = []

    def stop() -> None:
        try:
            relay.stop(timeout_s=60.0)
        except BaseException as exc:
            errors.append(exc)

    stopper = threading.Thread(target=stop, daemon=True)
    stopper.start()
    stopper.join(WAIT_S)
    assert not stopper.is_alive() and errors == []
    assert relay_threads() == before
