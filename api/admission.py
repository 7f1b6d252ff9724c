"""Admission control without a COUNT per submit: queued-job counts, estimated per API process; and the
tenant's quotas (its queued and scheduled jobs per queue, its tokens per minute).

The estimate of a queue's queued jobs (and of one tenant's queued jobs in it) is the last count plus the
jobs this process admitted since, so most submits read nothing. It is counted again when it is older than
REFRESH_S (by one submit, while the others answer from the estimate: under load every submit in flight
found it stale at once), and whenever it says the queue is full, so a queue that drained is never refused on
a stale number. A count reads the job tallies (core/store/job_tallies.py: the (queue, tenant, status) rows the
triggers on jobs keep, and the deltas not folded yet), never the rows: its cost follows the tenants and the
unfolded deltas, whatever the backlog or `max_queued`. It is exact as of its snapshot, as a COUNT was: it
sees every committed job, and the submit's own transaction's. What the estimate can miss are other API
processes' admissions since the last count: with R replicas each admitting at most A jobs per REFRESH_S, a
queue overshoots `max_queued` by at most about (R - 1) x A, plus the submits in flight at that moment
(docs/getting-started/postgres-redis.md, "Admission control").
Jobs leaving the queue are not subtracted between counts, so the estimate errs towards "full", and a full
verdict is always counted again.

A tenant's scheduled jobs in a lane are read from the tallies at each submit that schedules one (no
estimate: the read is a few rows). Tokens per minute are read from the store at each submit of a tenant that
has the limit (core/store/token_usage.py): one indexed range sum, so every API process sees every other's
jobs.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.orm import Session

from conveyor.core.lanes import describe_lane
from conveyor.core.store import jobs, token_usage
from conveyor.core.store.tenants import TenantLimits

REFRESH_S = 0.5

_Key = tuple[str, str | None]  # (queue, tenant or None for every tenant)


@dataclass
class _Estimate:
    queued: int
    counted_at: float
    counting: bool = False  # a submit is counting it again (the others answer from it meanwhile)


@dataclass(frozen=True)
class Refusal:
    """Why a tenant's submit is refused: 429 with Retry-After when waiting helps, else 422."""

    code: str
    field: str
    message: str
    retry_after_s: int | None


class AdmissionGauge:
    def __init__(self, refresh_s: float = REFRESH_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._refresh_s = refresh_s
        self._clock = clock
        self._lock = threading.Lock()
        self._estimates: dict[_Key, _Estimate] = {}

    def has_room(self, session: Session, queue: str, max_queued: int, tenant_id: str | None = None) -> bool:
        """Whether one more job fits under `max_queued` (in the queue; with `tenant_id`, that tenant's jobs
        in it); reads the tallies only when the estimate is stale or says no."""
        key = (queue, tenant_id)
        with self._lock:
            estimate = self._estimates.get(key)
            if estimate is not None and estimate.queued < max_queued:
                if estimate.counting or self._clock() - estimate.counted_at < self._refresh_s:
                    return True  # fresh, or being counted again by another submit: one count at a time
                estimate.counting = True
        counted_at = self._clock()
        try:
            queued = jobs.count_queued(session, queue, tenant_id)
        finally:
            if estimate is not None:
                estimate.counting = False  # a failed count leaves the estimate stale, to be counted next
        with self._lock:
            self._estimates[key] = _Estimate(queued, counted_at)
        return queued < max_queued

    def admitted(self, queue: str, tenant_id: str | None = None) -> None:
        """One more job of `queue` (of `tenant_id`) was committed by this process."""
        with self._lock:
            for key in {(queue, None), (queue, tenant_id)}:
                estimate = self._estimates.get(key)
                if estimate is not None:
                    estimate.queued += 1


def queued_refusal(session: Session, gauge: AdmissionGauge, limits: TenantLimits, tenant_id: str, lane: str,
                   retry_after_s: int) -> Refusal | None:
    """The tenant already has its max_queued jobs queued in `lane` (a model's queue, core/lanes.py)."""
    if limits.max_queued is None or gauge.has_room(session, lane, limits.max_queued, tenant_id):
        return None
    message = (f"queue: tenant {tenant_id} has {limits.max_queued} jobs queued in the {describe_lane(lane)}, "
               f"its max_queued; retry after {retry_after_s} s")
    return Refusal("tenant_queue_full", "queue", message, retry_after_s)


def scheduled_refusal(session: Session, limit: int, tenant_id: str, lane: str, retry_after_s: int,
                      ) -> Refusal | None:
    """The tenant already has `limit` jobs (its max_queued, else its queue's) scheduled in `lane`: scheduled
    jobs are not in the queue's depth, yet a tenant may not park an unbounded backlog for later."""
    if jobs.count_scheduled_in(session, lane, tenant_id) < limit:
        return None
    message = (f"run_at: tenant {tenant_id} has {limit} jobs scheduled in the {describe_lane(lane)}, as many "
               "as it may queue; retry once some are due")
    return Refusal("tenant_schedule_full", "run_at", message, retry_after_s)


@dataclass(frozen=True)
class Reserved:
    """What a job's tokens are, for a refusal: the field that asked for them and how they add up."""

    field: str = "max_tokens"
    sum: str = "prompt + max_tokens"


EMBEDDING_TOKENS = Reserved("input", "the inputs' tokens")  # an embedding job writes nothing


def tokens_refusal(session: Session, limits: TenantLimits, tenant_id: str, needed: int, now: datetime,
                   reserved: Reserved = Reserved()) -> Refusal | None:
    """`needed` (the job's prompt tokens + what it may write) would take the tenant past its tokens per
    minute."""
    limit = limits.tokens_per_minute
    if limit is None:
        return None
    if needed > limit:
        message = (f"{reserved.field}: {reserved.sum} ({needed}) exceeds tenant {tenant_id}'s "
                   f"tokens_per_minute ({limit}); no wait makes it fit")
        return Refusal("tokens_per_minute_exceeded", reserved.field, message, None)
    if token_usage.tokens_used(session, tenant_id, now) + needed <= limit:
        return None
    use = token_usage.window_use(session, tenant_id, now)  # the slow path: only for a refusal
    wait = max(1, math.ceil(use.seconds_until_room(needed, limit, now)))
    message = (f"tokens_per_minute: tenant {tenant_id} used {use.total} of its {limit} tokens in the last "
               f"minute, and this job reserves {needed} ({reserved.sum}); retry after {wait} s")
    return Refusal("tokens_per_minute_exceeded", "tokens_per_minute", message, wait)
