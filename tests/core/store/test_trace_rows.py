"""A trace export's reads (core/store/trace_rows.py): the jobs created in [since, until) of every status,
oldest first, filtered by model (its lanes only, not a longer model id's), queue and tenant, paged by keyset
over many chunks without losing or repeating a job."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.store import jobs, keys
from conveyor.core.store.tables import DEFAULT_TENANT
from conveyor.core.store.trace_rows import TEXT_COLUMNS, TraceWindow, trace_rows

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)


def add_job(session: Session, at: datetime, *, lane: str = "m:interactive", tenant: str = DEFAULT_TENANT,
            run_at: datetime | None = None) -> str:
    keys.ensure_tenant(session, tenant, at)
    new = jobs.NewJob(tenant_id=tenant, queue=lane, prompt="secret prompt", messages=None,
                      params={"max_tokens": 4}, meta=None, webhook=None, idempotency_key=None,
                      request_hash="h", prompt_tokens=2, ttl_s=None, timeout_s=None, run_at=run_at)
    return jobs.add(session, new, at).id


def ids(session_factory: sessionmaker[Session], window: TraceWindow, chunk: int = 1000) -> list[str]:
    return [row.id for row in trace_rows(session_factory, window, chunk=chunk)]


def test_the_window_holds_since_and_not_until(session_factory: sessionmaker[Session]) -> None:
    with session_factory() as session:
        before, first, second, at_until = (add_job(session, T0 + timedelta(seconds=s)) for s in (-1, 0, 1, 2))
    window = TraceWindow(T0, T0 + timedelta(seconds=2))
    assert ids(session_factory, window) == [first, second]
    assert before not in ids(session_factory, window) and at_until not in ids(session_factory, window)


def test_every_status_is_read_scheduled_queued_and_running_too(
        session_factory: sessionmaker[Session]) -> None:
    with session_factory() as session:
        queued, running, done, cancelled = (add_job(session, T0 + timedelta(seconds=s)) for s in range(4))
        scheduled = add_job(session, T0 + timedelta(seconds=4), run_at=T0 + timedelta(hours=1))
        assert jobs.claim(session, running, "w1", T0) is not None
        assert jobs.claim(session, done, "w1", T0) is not None
        assert jobs.complete(session, done, 1, result_text="out", finish_reason="stop", prompt_tokens=2,
                             completion_tokens=3, preemptions=0, first_token_at=T0, now=T0)
        assert jobs.cancel(session, cancelled, DEFAULT_TENANT, T0) is not None
    rows = list(trace_rows(session_factory, TraceWindow(T0, T0 + timedelta(minutes=1))))
    assert [(row.id, row.status) for row in rows] == [
        (queued, "queued"), (running, "running"), (done, "succeeded"), (cancelled, "cancelled"),
        (scheduled, "scheduled")]
    assert rows[2].completion_tokens == 3 and rows[2].result_text == "out"


def test_filters_by_model_queue_and_tenant(session_factory: sessionmaker[Session]) -> None:
    with session_factory() as session:
        m_chat = add_job(session, T0, lane="m:interactive", tenant="acme")
        m_docs = add_job(session, T0 + timedelta(seconds=1), lane="m:documents")
        longer = add_job(session, T0 + timedelta(seconds=2), lane="m:8b:interactive")  # model `m:8b`
        odd = add_job(session, T0 + timedelta(seconds=3), lane="m_%:interactive")  # LIKE's wildcards
    window = TraceWindow(T0, T0 + timedelta(minutes=1))
    assert ids(session_factory, window) == [m_chat, m_docs, longer, odd]
    assert ids(session_factory, TraceWindow(window.since, window.until, model="m")) == [m_chat, m_docs]
    assert ids(session_factory, TraceWindow(window.since, window.until, model="m:8b")) == [longer]
    assert ids(session_factory, TraceWindow(window.since, window.until, model="m_%")) == [odd]
    assert ids(session_factory, TraceWindow(window.since, window.until, queue="interactive")) == [
        m_chat, longer, odd]
    assert ids(session_factory, TraceWindow(window.since, window.until, model="m", queue="interactive")) == [
        m_chat]
    assert ids(session_factory, TraceWindow(window.since, window.until, tenant="acme")) == [m_chat]
    assert ids(session_factory, TraceWindow(window.since, window.until, queue="nteractive")) == []


def test_keyset_paging_reads_each_job_once_across_chunks(session_factory: sessionmaker[Session]) -> None:
    with session_factory() as session:
        # Five share one created_at: the key's id decides between them, across a chunk's edge.
        added = [add_job(session, T0) for _ in range(5)] + [add_job(session, T0 + timedelta(seconds=1))
                                                              for _ in range(2)]
    window = TraceWindow(T0, T0 + timedelta(minutes=1))
    want = sorted(added[:5]) + sorted(added[5:])
    assert ids(session_factory, window, chunk=2) == want
    assert ids(session_factory, window, chunk=7) == want  # a last chunk exactly full, then an empty one
    assert ids(session_factory, window, chunk=1) == want


def test_text_columns_are_read_only_when_asked(session_factory: sessionmaker[Session]) -> None:
    with session_factory() as session:
        add_job(session, T0)
    window = TraceWindow(T0, T0 + timedelta(minutes=1))
    plain = next(iter(trace_rows(session_factory, window)))
    with_text = next(iter(trace_rows(session_factory, window, with_text=True)))
    assert not set(TEXT_COLUMNS) & set(plain._fields)
    assert with_text.prompt == "secret prompt" and with_text.messages is None
