"""Fair share inside a queue: which queued jobs a worker claims next, and the claim itself.

A broker message (or an in-process wake-up) says only "a job of queue Q may be ready"; the worker then
claims the next jobs of Q in fair order, whichever they are (`claim_fair`):
  1. PostgreSQL: the queue's claim lock (`pg_advisory_xact_lock`, held to the commit), so two workers never
     both see a tenant under its max_running and both start one more. SQLite (embedded) has one process,
     and its claims of one queue come from one feeder thread.
  2. Reads of the queue's running jobs (every claim) and queued jobs (reused by a worker for up to
     QUEUED_VIEW_S; see FairState) per stream, with each tenant's weight and max_running. The queued read
     counts each stream only up to a cap and finds it by a skip scan of an index
     (core/store/queued_streams.py), so its cost follows the number of streams, not the backlog. A stream
     is one tenant's own submissions, or one of its batches (the job's batch_id column, which only the
     batch runner sets: a client's metadata never makes a stream).
  3. The plan (`plan`, pure): job by job, the tenant with the fewest running sequences per unit of weight
     among those with queued work under their max_running (a job of n choices runs n sequences: what it
     holds of the engine's running set, core/store/jobs/sequences.py); ties go to the tenant this worker
     served least recently (so a single free slot goes round-robin), then to the oldest work. Within the
     tenant, the same rule over its streams (fewest running, least recently served, oldest).
  4. Per planned stream, its most urgent queued jobs (priority, then the least slack to a deadline still
     ahead, then arrival: `queued_streams.urgent_ids`) are taken `FOR UPDATE SKIP LOCKED` and claimed by
     one conditional UPDATE (`status = 'queued'`) that reads them first and returns them: one statement,
     and a job is still claimed exactly once.
A tenant that arrives while another holds every slot gets the next slots that free up (within one job's
time, plus up to QUEUED_VIEW_S before a worker's reused view sees it), until its running jobs per weight
catch up.
"""

from __future__ import annotations

import functools
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Select, Update, bindparam, func, select, text
from sqlalchemy.orm import Session

from conveyor.core.lifecycle import RUNNING
from conveyor.core.store import queued_streams, webhook_events
from conveyor.core.store.jobs.claims import ClaimedJob, claim_params, claim_statement, claimed_rows, unclaim
from conveyor.core.store.jobs.sequences import sequences_of, sequences_sql, stored_n
from conveyor.core.store.tables import Job, Tenant
from conveyor.core.store.tenants import TenantLimits

CLAIM_LOCK_SPACE = 0x636F6E76  # the first key of the claim locks ("conv"); the second is the queue's crc32
MAX_SERVED_ENTRIES = 4096  # tenants and streams a worker remembers serving (the oldest are forgotten)
CLAIM_IDLE_TIMEOUT_MS = 5000  # a claim transaction idle this long (its worker frozen) is ended by Postgres
QUEUED_VIEW_S = 0.5  # how long a worker reuses its read of a queue's queued jobs (FairState)
STREAM_COUNT_CAP = 64  # a stream's queued jobs are counted up to this (or the claim's size, if larger)


@dataclass(frozen=True)
class Stream:
    tenant_id: str
    batch_id: str | None  # None: the tenant's own submissions


@dataclass
class StreamLoad:
    queued: int = 0
    running: int = 0
    oldest_queued_at: datetime | None = None
    counted_to_cap: bool = False  # `queued` is a lower bound: the stream holds at least that many


@dataclass(frozen=True)
class Share:
    weight: float
    max_running: int | None


class ServedOrder:
    """When this worker last started a job for each tenant and stream (a sequence number; never: -1).
    Ties in the plan go to whoever was served least recently. Thread-safe; bounded."""

    def __init__(self, max_entries: int = MAX_SERVED_ENTRIES) -> None:
        self._lock = threading.Lock()
        self._seq = 0
        self._last: dict[str | Stream, int] = {}
        self._max_entries = max_entries

    @property
    def seq(self) -> int:
        return self._seq

    def last(self, key: str | Stream) -> int:
        with self._lock:
            return self._last.get(key, -1)

    def note(self, key: str | Stream) -> None:
        with self._lock:
            self._seq += 1
            self._last.pop(key, None)
            self._last[key] = self._seq  # insertion order is serving order: the first entry is the oldest
            if len(self._last) > self._max_entries:
                del self._last[next(iter(self._last))]


@dataclass
class _QueuedView:
    loads: dict[Stream, StreamLoad]  # queued counts and oldest only
    shares: dict[str, Share]
    read_at: float  # time.monotonic()


class FairState:
    """One worker's memory of one queue between its claims: whom it served last, and the queue's queued
    streams as last read. That read is reused for QUEUED_VIEW_S (minus this worker's own claims; a stream
    counted to the cap stays at the cap); running jobs are read fresh at every claim, so max_running and the
    running share are exact. A claim whose plan comes up short of what it was asked for, or that finds
    fewer rows than planned, reads the queued jobs again: a reused view never leaves a job unclaimed, it
    may only hold back a newly arrived tenant's first turn by up to QUEUED_VIEW_S."""

    def __init__(self, view_s: float = QUEUED_VIEW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.served = ServedOrder()
        self._view_s = view_s
        self._clock = clock
        self._view: _QueuedView | None = None

    def cached_view(self) -> _QueuedView | None:
        view = self._view
        if view is None or self._clock() - view.read_at >= self._view_s:
            return None
        return view

    def keep_view(self, loads: dict[Stream, StreamLoad], shares: dict[str, Share]) -> _QueuedView:
        self._view = _QueuedView(loads, shares, self._clock())
        return self._view

    def forget_view(self) -> None:
        self._view = None


@dataclass
class _TenantPlan:
    tenant_id: str
    share: Share
    streams: dict[Stream, StreamLoad] = field(default_factory=dict)

    @property
    def running(self) -> int:
        return sum(load.running for load in self.streams.values())

    @property
    def queued(self) -> int:
        return sum(load.queued for load in self.streams.values())

    def open(self) -> bool:
        under_cap = self.share.max_running is None or self.running < self.share.max_running
        return self.queued > 0 and under_cap

    def oldest(self) -> datetime:
        return min(load.oldest_queued_at for load in self.streams.values() if load.oldest_queued_at)


def plan(loads: dict[Stream, StreamLoad], shares: dict[str, Share], count: int, served: ServedOrder,
         ) -> list[Stream]:
    """The streams of the next `count` jobs to start, in order (fewer when no tenant may start more).
    `served` is read, not changed: the caller notes the picks it claimed."""
    tenants: dict[str, _TenantPlan] = {}
    for stream, load in loads.items():
        tenant = tenants.setdefault(stream.tenant_id, _TenantPlan(stream.tenant_id, shares[stream.tenant_id]))
        tenant.streams[stream] = StreamLoad(load.queued, load.running, load.oldest_queued_at)
    picked: dict[str | Stream, int] = {}  # picks of this plan, more recent than anything in `served`

    def last(key: str | Stream) -> int:
        return picked.get(key, served.last(key))

    picks: list[Stream] = []
    while len(picks) < count:
        candidates = [tenant for tenant in tenants.values() if tenant.open()]
        if not candidates:
            break
        tenant = min(candidates, key=lambda t: (t.running / t.share.weight, last(t.tenant_id), t.oldest(),
                                                t.tenant_id))
        stream = min((s for s, load in tenant.streams.items() if load.queued > 0),
                     key=lambda s: _stream_order(s, tenant.streams[s], last(s)))
        tenant.streams[stream].queued -= 1
        tenant.streams[stream].running += 1
        picked[tenant.tenant_id] = picked[stream] = served.seq + len(picks) + 1
        picks.append(stream)
    return picks


def _stream_order(stream: Stream, load: StreamLoad, last_served: int) -> tuple[int, int, datetime, str]:
    assert load.oldest_queued_at is not None, stream
    return load.running, last_served, load.oldest_queued_at, stream.batch_id or ""


def claim_fair(session: Session, queue: str, count: int, worker_id: str, clock: Callable[[], datetime],
               defaults: TenantLimits, state: FairState, *, by_arrival: bool = False) -> list[ClaimedJob]:
    """Claims queued jobs of `queue` filling up to `count` places in fair order (module docstring) and
    commits: queued -> running, attempts + 1, started_at = now, as `jobs.claim_many`. A place is an engine
    sequence: a job of n choices takes n (core/store/jobs/sequences.py), and one wider than all `count` places
    is claimed alone. Returns the claimed rows (plain rows, with each tenant's cache namespace:
    core/store/jobs/claims.py ClaimedJob).

    `now` is read from `clock` once the queue's claim lock is held: a wait for the lock must not age the
    claim, since the reconciler requeues a claim older than dispatch_grace_s that its worker does not hold.
    `by_arrival`: a stream's jobs oldest first, their priority and deadline ignored (scheduling=arrival)."""
    if count <= 0:
        return []
    _lock_queue(session, queue)
    now = clock()
    running, running_shares = _running_loads(session, queue, defaults)
    claimed: list[ClaimedJob] = []
    subscribed: set[str] = set()  # claimed tenants with an enabled webhook subscription
    places = count
    view, fresh = state.cached_view(), False
    while True:
        if view is None:
            view, fresh = state.keep_view(*_queued_loads(session, queue, now, defaults, count)), True
        picks = _plan(view, running, running_shares, places, state)
        for stream, n in Counter(picks).items():
            if places <= 0:
                break
            rows = _claim_most_urgent(session, queue, stream, n, worker_id, now, by_arrival)
            subscribed.update(job.tenant_id for job in rows if job.subscribed)
            got = _within_places(session, rows, places, whole_room=not claimed)
            _took(view, stream, len(got), state, short=len(got) < n)
            taken = sum(_sequences(job) for job in got)
            running[stream] = running.get(stream, 0) + taken
            places -= taken
            # NOTE: a tenant claimed here may queue nothing when the queue is read again, yet it runs now:
            # its share must outlive the view it came from.
            running_shares.setdefault(stream.tenant_id, view.shares[stream.tenant_id])
            claimed += got
        if places <= 0 or fresh:
            break
        view = None  # the reused view came up short: a reused view must never leave claimable jobs behind
    if claimed:  # once per claim, not per stream: its one subscriptions read, if any tenant has some
        webhook_events.enqueue_started_events(session, claimed, now, subscribed)
    session.commit()
    for job in claimed:
        state.served.note(job.tenant_id)
        state.served.note(Stream(job.tenant_id, job.batch_id))
    return claimed


def _sequences(job: ClaimedJob) -> int:
    return sequences_of(job.kind, stored_n(job.params), job.inputs)


def _within_places(session: Session, got: list[ClaimedJob], places: int, *, whole_room: bool,
                   ) -> list[ClaimedJob]:
    """The claimed jobs that fit `places` sequences, in order; the rest handed back to the queue in this
    transaction (a job of many choices takes as many places). A job wider than all of the room still starts
    when the room is whole (`whole_room`: nothing claimed yet), as worker/queue_room.py lets it."""
    kept: list[ClaimedJob] = []
    for job in got:
        width = _sequences(job)
        if width > places and not (whole_room and not kept):
            break
        kept.append(job)
        places -= width
    if len(kept) < len(got):
        unclaim(session, [job.id for job in got[len(kept):]])
    return kept


def _plan(view: _QueuedView, running: dict[Stream, int], running_shares: dict[str, Share], count: int,
          state: FairState) -> list[Stream]:
    loads = {stream: StreamLoad(load.queued, 0, load.oldest_queued_at) for stream, load in view.loads.items()}
    for stream, n in running.items():
        loads.setdefault(stream, StreamLoad()).running = n
    return plan(loads, {**view.shares, **running_shares}, count, state.served)


def _took(view: _QueuedView, stream: Stream, n: int, state: FairState, *, short: bool) -> None:
    """Keeps the reused view in step with this worker's own claims; forgets it when it proved wrong."""
    load = view.loads.get(stream)
    if short or load is None:
        state.forget_view()
    elif not load.counted_to_cap:
        load.queued -= n


_RUNNING_LOADS = (  # built once, as building it cost more than running it; its parameter: queue
    select(Job.tenant_id, Job.batch_id, func.sum(sequences_sql()), Tenant.weight, Tenant.max_running)
    .join(Tenant, Tenant.id == Job.tenant_id)
    .where(Job.queue == bindparam("queue", type_=Job.queue.type), Job.status == RUNNING)
    .group_by(Job.tenant_id, Job.batch_id, Tenant.weight, Tenant.max_running)
)


def _running_loads(session: Session, queue: str, defaults: TenantLimits,
                   ) -> tuple[dict[Stream, int], dict[str, Share]]:
    """Running sequences of `queue` per stream (jobs are few: what the fleet runs; a job of n choices runs n
    sequences, core/store/jobs/sequences.py), and each such tenant's share."""
    running: dict[Stream, int] = {}
    shares: dict[str, Share] = {}
    rows = session.connection().execute(_RUNNING_LOADS, {"queue": queue})  # plain rows: no ORM layer
    for tenant_id, batch_id, count, weight, max_running in rows:
        running[Stream(tenant_id, batch_id)] = int(count)
        shares[tenant_id] = _share(weight, max_running, defaults)
    return running, shares


def _queued_loads(session: Session, queue: str, now: datetime, defaults: TenantLimits, count: int,
                  ) -> tuple[dict[Stream, StreamLoad], dict[str, Share]]:
    """Claimable jobs of `queue` per stream (counted up to the cap) with the oldest's creation, and each
    such tenant's share."""
    cap = max(count, STREAM_COUNT_CAP)
    loads: dict[Stream, StreamLoad] = {}
    shares: dict[str, Share] = {}
    params = queued_streams.stream_loads_params(queue, now, cap)
    rows = session.connection().execute(_queued_with_shares(), params)
    for tenant_id, batch_id, queued, oldest, weight, max_running in rows:
        if queued:
            loads[Stream(tenant_id, batch_id)] = StreamLoad(int(queued), 0, oldest, queued >= cap)
            shares[tenant_id] = _share(weight, max_running, defaults)
    return loads, shares


@functools.cache
def _queued_with_shares() -> Select[Any]:
    """queued_streams.stream_loads' statement with each stream's tenant's weight and max_running, built
    once: one statement, not a second read of the tenants."""
    loads = queued_streams.stream_loads_statement(False).subquery("queued_loads")
    # One index probe per stream and column (the streams are few; a join may read the whole tenants table).
    weight, max_running = (select(column).where(Tenant.id == loads.c.tenant_id).scalar_subquery()
                           for column in (Tenant.weight, Tenant.max_running))
    return select(*loads.c, weight, max_running)


def _share(weight: float | None, max_running: int | None, defaults: TenantLimits) -> Share:
    return Share(weight if weight is not None else defaults.weight,
                 max_running if max_running is not None else defaults.max_running)


def _claim_most_urgent(session: Session, queue: str, stream: Stream, n: int, worker_id: str, now: datetime,
                       by_arrival: bool) -> list[ClaimedJob]:
    """The stream's n most urgent claimable jobs (queued_streams.urgent_ids), claimed, oldest first."""
    params = {**queued_streams.urgent_params(queue, stream.tenant_id, stream.batch_id, n, now),
              **claim_params(worker_id, now)}
    rows = claimed_rows(session, _claim_urgent(stream.batch_id is not None, by_arrival), params)
    return sorted(rows, key=lambda job: (job.created_at, job.id))


@functools.cache
def _claim_urgent(of_batch: bool, by_arrival: bool) -> Update:
    """The claim of a stream's n most urgent jobs, built once.

    NOTE: the ids come from a MATERIALIZED CTE, read once: a plain `WHERE id IN (SELECT ... LIMIT n FOR
    UPDATE SKIP LOCKED)` may be run again by PostgreSQL per row, each time skipping the rows just locked, and
    so update more than n."""
    chosen = queued_streams.urgent_ids(of_batch, by_arrival).cte("urgent_ids").prefix_with("MATERIALIZED")
    return claim_statement(Job.id.in_(select(chosen.c.id)))


def _lock_queue(session: Session, queue: str) -> None:
    """PostgreSQL: one claimer of `queue` at a time, until its transaction ends (released at commit)."""
    if session.get_bind().dialect.name != "postgresql":
        return
    key = zlib.crc32(queue.encode()) - (1 << 31)  # the second key is an int4
    params = {"idle_ms": str(CLAIM_IDLE_TIMEOUT_MS), "space": CLAIM_LOCK_SPACE, "key": key}
    session.execute(_LOCK_QUEUE, params)


# A claimer frozen mid-transaction (SIGSTOP, a paused VM) would hold the queue's lock, and so stall the whole
# fleet's claims of it, until it woke up; the server ends such a session after CLAIM_IDLE_TIMEOUT_MS idle in
# its transaction (set_config(..., true): for this transaction only, as SET LOCAL). One round trip for both.
_LOCK_QUEUE = text("SELECT set_config('idle_in_transaction_session_timeout', :idle_ms, true),"
                   " pg_advisory_xact_lock(:space, :key)")
