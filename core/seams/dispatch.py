"""Handing jobs to the broker: the publisher seam, and publishing with the store kept in step.

Dispatch scheme: "reconciler". Whoever creates a job (the API's submit, a batch runner) commits it, then
publishes its id and marks it dispatched. If publishing fails (or the process dies in between) the job stays
queued with dispatched_at NULL, and a worker's reconciler re-publishes it after `dispatch_grace_s`. Duplicate
messages are harmless: claiming a job is a conditional UPDATE. Messages carry only the job id; the store is
the source of truth. Publishers (core/seams/broker.py for Redis, worker/in_process_queue.py when embedded) are
passed in, so the API never imports the worker.

The API hands its committed jobs to a `DispatchRelay`: one thread that publishes whatever has gathered and
marks the whole group dispatched in one UPDATE, so a submit's request does one transaction (its insert)
and never waits on the broker. The mark stays per job: it is what tells a published job from one whose
publisher died between its commit and its publish, which nothing else records. After the broker lost its
queues, the reconciler publishes the queued jobs again with `publish_in_order` and marks nothing: its walk
keeps its place in one row (core/store/republish_walk.py).
"""

from __future__ import annotations

import logging
import queue as stdlib_queue
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.background import BackgroundLoop
from conveyor.core.clock import utcnow
from conveyor.core.store import jobs

log = logging.getLogger(__name__)

MAX_RELAY_GROUP = 500  # jobs published and marked per round
_STOP = ("", "")

Publish = Callable[[str, str], None]  # (job_id, queue)


class JobPublisher(Protocol):
    def publish(self, job_id: str, queue: str) -> None:
        """Hands a job id to the broker's queue; may raise (the reconciler retries later)."""

    def ping(self) -> bool:
        """Whether the broker is reachable now."""


class Dispatcher(Protocol):
    def dispatch(self, job_id: str, queue: str) -> None:
        """Hands a job whose insert has committed towards the broker; never blocks for long, never raises."""


def publish_and_mark(
    sessions: sessionmaker[Session], publish: Publish, pending: list[tuple[str, str]]
) -> int:
    """Publishes (job_id, queue) pairs in order and marks the published ones dispatched. Stops at the first
    failure (the broker is likely down): the rest stay undispatched for the next reconcile. Returns how
    many went out. They are marked with the time publishing began, never later than the message reached
    the broker: a broker found empty after that time (the reconciler's lost-messages rule) counts them."""
    publishing_since = utcnow()
    sent = publish_in_order(publish, pending)
    if sent:
        with sessions() as session:
            jobs.mark_dispatched(session, [job_id for job_id, _ in pending[:sent]], publishing_since)
    return sent


def publish_in_order(publish: Publish, pending: Sequence[tuple[str, str]]) -> int:
    """Publishes (job_id, queue) pairs in order, stopping at the first failure (logged); returns how many
    went out (the first ones). Marks nothing: a broker restart's republish (core/store/republish_walk.py)
    keeps its place in one row instead."""
    for sent, (job_id, queue) in enumerate(pending):
        try:
            publish(job_id, queue)
        except Exception as exc:
            log.warning("publish of %s to %s failed (%s: %s); the reconciler will retry",
                        job_id, queue, type(exc).__name__, exc)
            return sent
    return len(pending)


class DispatchRelay:
    """Publishes committed jobs from its own thread, in groups (see the module docstring). What it has not
    published when it stops, or what the broker refused, stays undispatched for the reconciler."""

    def __init__(self, sessions: sessionmaker[Session], publish: Publish) -> None:
        self._sessions = sessions
        self._publish = publish
        self._inbox: stdlib_queue.SimpleQueue[tuple[str, str]] = stdlib_queue.SimpleQueue()
        self._loop = BackgroundLoop("dispatch-relay", lambda _stop: self._run(),
                                    wake=lambda: self._inbox.put(_STOP))
        self._start_lock = threading.Lock()

    def dispatch(self, job_id: str, queue: str) -> None:
        """After the job's insert committed; never blocks. The relay's thread starts with its first job."""
        self._inbox.put((job_id, queue))
        if not self._loop.is_alive():
            with self._start_lock:
                if not self._loop.started:
                    self._loop.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Publishes what is already waiting (within timeout_s), then stops."""
        self._loop.stop(timeout_s)

    def _run(self) -> None:
        stopping = False
        while not stopping:
            group, stopping = self._next_group()
            if not group:
                continue
            try:
                publish_and_mark(self._sessions, self._publish, group)
            except Exception as exc:  # the store refused the mark: the reconciler publishes them again
                log.warning("dispatch: marking %d job(s) dispatched failed (%s: %s)", len(group),
                            type(exc).__name__, exc)

    def _next_group(self) -> tuple[list[tuple[str, str]], bool]:
        group = [self._inbox.get()]
        while len(group) < MAX_RELAY_GROUP:
            try:
                group.append(self._inbox.get_nowait())
            except stdlib_queue.Empty:
                break
        stopping = _STOP in group
        return [item for item in group if item != _STOP], stopping
