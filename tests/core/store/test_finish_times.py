"""Predicted run and finish times (core/store/finish_times.py): the queue's output rate over the window, the
output its queued and running jobs may still write, and the pace its live workers published; on SQLite and
PostgreSQL."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy.orm import Session

from conveyor.core.store import finish_times, jobs, workers
from conveyor.core.store.tables import DEFAULT_TENANT

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)


def _job(session: Session, queue: str = "interactive", **params: Any) -> str:
    new = jobs.NewJob(tenant_id=DEFAULT_TENANT, queue=queue, prompt="p", messages=None, params=params,
                      meta=None, webhook=None, idempotency_key=None, request_hash="h", prompt_tokens=1,
                      ttl_s=None, timeout_s=None)
    return jobs.add(session, new, T0).id


def _finish(session: Session, job_id: str, tokens: int, at: datetime) -> None:
    assert jobs.claim(session, job_id, "w1", T0) is not None
    assert jobs.complete(session, job_id, 1, result_text="x", finish_reason="length", prompt_tokens=1,
                         completion_tokens=tokens, preemptions=0, first_token_at=None, now=at)


def test_no_prediction_until_the_queue_delivered_something(session: Session) -> None:
    _job(session, max_tokens=10)
    assert finish_times.queue_rate(session, "interactive", T0) is None


def test_the_rate_of_the_window_and_the_work_ahead(session: Session) -> None:
    now = T0 + timedelta(minutes=10)
    _finish(session, _job(session, max_tokens=400), 300, now - timedelta(minutes=1))  # in the window
    _finish(session, _job(session, max_tokens=400), 900, now - timedelta(minutes=6))  # before it
    _finish(session, _job(session, "documents", max_tokens=400), 900, now)  # another queue
    _job(session, max_tokens=100, n=2)  # queued: up to 200 tokens
    running = _job(session)  # queued then claimed: the default 16 tokens
    assert jobs.claim(session, running, "w1", now) is not None
    rate = finish_times.queue_rate(session, "interactive", now)
    assert rate == finish_times.QueueRate(tokens_per_s=1.0, tokens_ahead=216)  # 300 tokens over 300 s
    assert rate.finish_at(now, 84) == now + timedelta(seconds=300)


def _worker(session: Session, worker_id: str, queues: list[str], pace: dict[str, float] | None,
            seen: datetime) -> None:
    workers.register(session, worker_id, hostname="h", pid=1, queues=queues, now=seen)
    assert workers.heartbeat(session, worker_id, seen, pace)


def test_the_pace_is_the_median_of_the_queues_live_workers(session: Session) -> None:
    assert finish_times.queue_pace(session, "interactive", T0, dead_after_s=15) is None
    _worker(session, "w1", ["interactive"], {"step_s": 0.02, "prefill_token_s": 0.001}, T0)
    _worker(session, "w2", ["interactive", "documents"], {"step_s": 0.04, "prefill_token_s": 0.003}, T0)
    _worker(session, "w3", ["interactive"], {"step_s": 0.03, "prefill_token_s": 0.002}, T0)
    slow = {"step_s": 9.0, "prefill_token_s": 9.0}
    _worker(session, "dead", ["interactive"], slow, T0 - timedelta(minutes=1))
    _worker(session, "other", ["documents"], slow, T0)
    _worker(session, "new", ["interactive"], None, T0)  # has not measured one yet
    pace = finish_times.queue_pace(session, "interactive", T0, dead_after_s=15)
    assert pace == finish_times.Pace(step_s=0.03, prefill_token_s=0.002)
    assert pace.run_s(prompt_tokens=1000, max_tokens=100) == 1000 * 0.002 + 100 * 0.03


def test_the_forecast_starts_by_the_deadline_less_the_run_and_finishes_after_the_wait(session: Session,
                                                                                      ) -> None:
    now = T0 + timedelta(minutes=10)
    kwargs: dict[str, Any] = dict(deadline_s=60.0, prompt_tokens=500, max_tokens=100, choices=1,
                                  dead_after_s=15)
    unknown = finish_times.forecast(session, "interactive", now, **kwargs)
    assert unknown == finish_times.Forecast(start_by=now + timedelta(seconds=60), finish_at=None)

    _worker(session, "w1", ["interactive"], {"step_s": 0.1, "prefill_token_s": 0.01}, now)  # runs 15 s
    paced = finish_times.forecast(session, "interactive", now, **kwargs)
    assert paced == finish_times.Forecast(start_by=now + timedelta(seconds=45), finish_at=None)

    _finish(session, _job(session, max_tokens=400), 300, now - timedelta(minutes=1))  # 1 token/s
    _job(session, max_tokens=30)  # 30 s of work ahead
    rated = finish_times.forecast(session, "interactive", now, **kwargs)
    assert rated.finish_at == now + timedelta(seconds=30 + 15)
    no_deadline = finish_times.forecast(session, "interactive", now, **{**kwargs, "deadline_s": None})
    assert no_deadline.start_by is None


def test_a_process_reuses_its_read_of_the_rate_and_adds_the_jobs_it_admitted(session: Session) -> None:
    now = T0 + timedelta(minutes=10)
    _finish(session, _job(session, max_tokens=400), 300, now - timedelta(minutes=1))
    _job(session, max_tokens=100)
    seconds = [0.0]
    rates = finish_times.QueueRates(refresh_s=1.0, clock=lambda: seconds[0])
    assert rates.rate(session, "interactive", now) == finish_times.QueueRate(1.0, 100)
    _job(session, max_tokens=50)  # another process's job: unseen until the next read
    rates.admitted("interactive", 30)  # this process's own
    assert rates.rate(session, "interactive", now) == finish_times.QueueRate(1.0, 130)
    seconds[0] = 1.0
    assert rates.rate(session, "interactive", now) == finish_times.QueueRate(1.0, 150)  # read again
    rates.admitted("documents", 10)  # never read: nothing to add to
    assert rates.rate(session, "documents", now) is None
