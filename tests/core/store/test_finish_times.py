"""Predicted finish times (core/store/finish_times.py): the queue's output rate over the window and the output
its queued and running jobs may still write; on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy.orm import Session

from core.store import finish_times, jobs
from core.store.tables import DEFAULT_TENANT

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
