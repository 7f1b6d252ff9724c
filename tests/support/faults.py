"""The fault suite's central assertion (`check_exactly_once`), read from the database: every accepted job
reached a final state, once, for the right reason; and the waits the tests build their faults on.

The rest of the suite's machinery lives beside it in tests/support: fault_servers (its own PostgreSQL and
Redis), fault_store (the store as the tests read it), fault_stack (the api and worker processes), traffic
(steady submissions). Nothing here touches the shared services on 5432/6379: the fault tests kill and restart
their own.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from conveyor.core.lifecycle import TERMINAL_STATUSES
from conveyor.core.store.tables import Delivery, Job
from tests.support.fault_stack import Stack
from tests.support.fault_store import POLL_S, WAIT_S, Store, wait_until


@dataclass
class Outcome:
    jobs: dict[str, Job]
    deliveries: dict[str, list[Delivery]]


def describe(job: Job) -> str:
    return (f"{job.id} status={job.status} attempts={job.attempts} worker={job.worker_id} "
            f"error={job.error_code}:{(job.error_message or '')[:160]!r} dispatched_at={job.dispatched_at} "
            f"created_at={job.created_at} started_at={job.started_at} first_token_at={job.first_token_at} "
            f"finished_at={job.finished_at}")


def wait_final(store: Store, job_ids: Iterable[str], timeout_s: float, what: str = "") -> dict[str, Job]:
    """Waits until every job is in a final state; the AssertionError lists those that are not."""
    ids = set(job_ids)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            rows = store.jobs(ids)
        except Exception:  # the database may still be coming back
            rows = None
        if rows is not None:
            missing = ids - set(rows)
            assert not missing, f"accepted jobs missing from the store (lost): {sorted(missing)[:20]}"
            open_jobs = [job for job in rows.values() if job.status not in TERMINAL_STATUSES]
            if not open_jobs:
                return rows
            if time.monotonic() > deadline:
                listing = "\n  ".join(describe(j) for j in sorted(open_jobs, key=lambda j: j.created_at)[:30])
                raise AssertionError(
                    f"{len(open_jobs)} of {len(ids)} jobs {what}not final {timeout_s:.0f} s later "
                    f"(by status: {Counter(j.status for j in open_jobs)}):\n  {listing}")
        elif time.monotonic() > deadline:
            raise AssertionError(f"the store stayed unreachable for {timeout_s:.0f} s")
        time.sleep(POLL_S)


def wait_generating(store: Store, job_ids: Iterable[str], timeout_s: float = WAIT_S) -> dict[str, Job]:
    """Waits until every job is running with its first token stored; fails at once if one ended instead."""
    ids = set(job_ids)

    def generating() -> bool:
        rows = store.jobs(ids)
        ended = [describe(j) for j in rows.values() if j.status not in ("queued", "running")]
        others = [describe(j) for j in rows.values() if j.status in ("queued", "running")]
        assert not ended, f"jobs ended before they could be caught running: {ended}; the others: {others}"
        return len(rows) == len(ids) and all(j.status == "running" and j.first_token_at
                                             for j in rows.values())

    wait_until(generating, f"jobs {sorted(ids)} to be generating", timeout_s)
    return store.jobs(ids)


def succeeded_on(store: Store, worker_id: str | None) -> set[str]:
    """Ids of the jobs the store says that worker finished successfully."""
    return {j.id for j in store.jobs().values() if j.status == "succeeded" and j.worker_id == worker_id}


def running_on(store: Store, worker_id: str | None) -> set[str]:
    """Ids of the jobs the store says are running on that worker."""
    return {j.id for j in store.jobs().values() if j.status == "running" and j.worker_id == worker_id}


def check_exactly_once(
    store: Store,
    accepted: dict[str, str],
    *,
    within_s: float,
    expect: dict[str, set[str]] | None = None,
    max_attempts: int | None = None,
    stack: Stack | None = None,
    reruns_allowed: Iterable[str] = (),
) -> Outcome:
    """The guarantee, read from the database once every job has settled:

    - no accepted job is lost, and every job in the store (accepted or not: a submission whose answer was
      lost may still have been stored) reaches a final state within `within_s`;
    - one job per Idempotency-Key, and no job the traffic did not submit;
    - each job ended for the right reason: `succeeded` unless `expect` allows another status for it, and an
      `expired` or an engine failure only where allowed;
    - exactly once: each job has exactly one final-event delivery row (written in the transaction of the
      transition that applied, so a second completion would leave a second one), whose frozen payload
      agrees with the row; attempts <= max_attempts; and no worker computed a second result for it (a
      dropped duplicate in the worker logs) unless the job is in `reruns_allowed`.
    """
    expect = expect or {}
    wait_final(store, accepted.values(), within_s, "accepted ")
    everything = store.jobs()
    rows = wait_final(store, everything, 30.0, "stored ")  # jobs whose submit answer was lost, too
    problems: list[str] = []

    by_key: dict[str | None, list[Job]] = {}
    for job in rows.values():
        by_key.setdefault(job.idempotency_key, []).append(job)
    stray = [j.id for key, js in by_key.items() for j in js if key not in accepted]
    unaccepted_keys = [k for k in by_key if k not in accepted]
    if stray:
        problems.append(f"{len(stray)} stored job(s) the traffic never saw accepted "
                        f"(keys {unaccepted_keys[:10]})")
    for key, job_id in accepted.items():
        if [j.id for j in by_key.get(key, [])] != [job_id]:
            stored = [j.id for j in by_key.get(key, [])]
            problems.append(f"key {key}: accepted as {job_id}, stored as {stored}")

    deliveries = store.job_deliveries()
    for job in rows.values():
        allowed = expect.get(job.id, {"succeeded"})
        if job.status not in allowed:
            problems.append(f"wrong outcome (allowed {sorted(allowed)}): {describe(job)}")
        if job.status in ("succeeded", "failed") and (job.attempts < 1 or job.finished_at is None):
            problems.append(f"finished without an attempt: {describe(job)}")
        if max_attempts is not None and job.attempts > max_attempts:
            problems.append(f"ran {job.attempts} times (at most {max_attempts} expected): {describe(job)}")
        events = deliveries.get(job.id, [])
        if len(events) != 1:
            kinds = [d.event_type for d in events]
            problems.append(f"{len(events)} final-event records {kinds} (exactly 1 expected): "
                            f"{describe(job)}")
        for event in events:
            data = event.payload.get("data", {})
            if event.event_type != f"job.{job.status}" or data.get("status") != job.status:
                problems.append(f"final event {event.event_type} disagrees with the row: {describe(job)}")
            elif (data.get("attempts"), (data.get("result") or {}).get("text")) != (job.attempts,
                                                                                     job.result_text):
                problems.append(f"final event frozen at attempt {data.get('attempts')} disagrees with the "
                                f"row (result overwritten after the final transition?): {describe(job)}")
    if stack is not None:
        allowed_reruns = set(reruns_allowed)
        for job_id, n in stack.dropped_results().items():
            if job_id not in allowed_reruns:
                row = describe(rows[job_id]) if job_id in rows else ""
                problems.append(f"a worker computed {n} extra result(s) for {job_id} that another attempt "
                                f"owned (it ran more than once): {row}")
    assert not problems, f"{len(problems)} exactly-once problem(s) among {len(rows)} jobs:\n  " + "\n  ".join(
        problems[:40])
    return Outcome(rows, deliveries)
