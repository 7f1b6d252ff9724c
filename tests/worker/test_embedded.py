"""The embedded runtime (one process, SQLite, in-process queues): the same semantics as the Celery worker."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.clock import utcnow
from conveyor.core.protocol.service_tiers import TIER_PRIORITY
from conveyor.core.seams.dispatch import publish_and_mark
from conveyor.core.settings import Settings
from conveyor.core.store import finish_times, jobs
from conveyor.core.store.database import make_db_engine, make_session_factory
from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.worker.embedded import EmbeddedRuntime
from conveyor.worker.job_runner import JobRunner
from tests.support.live_server import wait_for
from tests.support.worker import LONG_JOB_TOKENS, add_job, get_job, lane, wait_finished, wait_generating


@pytest.fixture
def lite_sessions(migrated_sqlite_url: str) -> Iterator[sessionmaker[Session]]:
    db_engine = make_db_engine(migrated_sqlite_url)
    yield make_session_factory(db_engine)
    db_engine.dispose()


@pytest.fixture
def embedded_settings(make_settings: Callable[..., Any], sqlite_url: str, worker_model_dir: Path) -> Settings:
    settings: Settings = make_settings(
        database_url=sqlite_url, model=str(worker_model_dir), max_num_seqs=8, num_kv_blocks=512,
        queues={"documents": {"max_running": 1}},
    )
    return settings


@pytest.fixture
def runtimes() -> Iterator[list[EmbeddedRuntime]]:
    started: list[EmbeddedRuntime] = []
    yield started
    for runtime in started:
        runtime.stop(grace_s=0.0)


def _start(
    settings: Settings, sessions: sessionmaker[Session], runtimes: list[EmbeddedRuntime]
) -> EmbeddedRuntime:
    runtime = EmbeddedRuntime(settings, sessions=sessions)
    runtimes.append(runtime)
    runtime.start()
    return runtime


def _submit(runtime: EmbeddedRuntime, sessions: sessionmaker[Session], prompt: str | None, queue: str,
            **kwargs: Any) -> str:
    job_id = add_job(sessions, prompt, queue, **kwargs)
    assert publish_and_mark(sessions, runtime.publisher.publish, [(job_id, lane(queue))]) == 1
    return job_id


def test_jobs_in_both_queues_complete_with_the_offline_engine_text(
    embedded_settings: Settings, lite_sessions: sessionmaker[Session], runtimes: list[EmbeddedRuntime],
    worker_model_dir: Path,
) -> None:
    runtime = _start(embedded_settings, lite_sessions, runtimes)
    prompt = "Each worker runs one engine"
    ids = [_submit(runtime, lite_sessions, prompt, "interactive", max_tokens=16),
           _submit(runtime, lite_sessions, "Long documents are read in chunks", "documents", max_tokens=16)]

    done = wait_finished(lite_sessions, ids)

    assert [j.status for j in done] == ["succeeded", "succeeded"]
    expected = LLM(str(worker_model_dir), max_num_seqs=2, num_kv_blocks=512).generate(
        [prompt], SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert done[0].result_text == expected.text


def test_cancel_of_a_running_job_aborts_it_and_frees_its_kv_blocks(
    embedded_settings: Settings, lite_sessions: sessionmaker[Session], runtimes: list[EmbeddedRuntime]
) -> None:
    runtime = _start(embedded_settings, lite_sessions, runtimes)
    job_id = _submit(runtime, lite_sessions, "The model reads the prompt", "documents",
                     max_tokens=LONG_JOB_TOKENS, ignore_eos=True)
    wait_generating(lite_sessions, job_id)

    with lite_sessions() as session:
        jobs.cancel(session, job_id, "default", utcnow())

    wait_for(lambda: runtime.host.stats()["kv_blocks_used"] == 0, "the cancelled job's KV to be freed",
             timeout_s=30)
    assert runtime.host.stats()["totals"]["aborted_requests"] == 1  # type: ignore[index]
    job = get_job(lite_sessions, job_id)
    assert job.status == "cancelled" and job.result_text is None
    after = _submit(runtime, lite_sessions, "Next document", "documents", max_tokens=4)  # the slot came back
    assert wait_finished(lite_sessions, [after])[0].status == "succeeded"
    assert get_job(lite_sessions, job_id).status == "cancelled"


def test_documents_held_to_their_limit_while_interactive_jobs_pass(
    embedded_settings: Settings, lite_sessions: sessionmaker[Session], runtimes: list[EmbeddedRuntime]
) -> None:
    runtime = _start(embedded_settings, lite_sessions, runtimes)
    docs = [_submit(runtime, lite_sessions, f"Document {i}: the river is calm", "documents", max_tokens=150,
                    ignore_eos=True) for i in range(10)]
    interactive = _submit(runtime, lite_sessions, "Good morning!", "interactive", max_tokens=8)

    done = wait_finished(lite_sessions, [*docs, interactive])

    assert all(j.status == "succeeded" for j in done)
    doc_rows, chat_row = done[:-1], done[-1]
    assert chat_row.finished_at is not None
    assert any(d.started_at is not None and d.started_at > chat_row.finished_at for d in doc_rows)
    by_start = sorted(doc_rows, key=lambda d: d.started_at)  # type: ignore[arg-type, return-value]
    for previous, current in itertools.pairwise(by_start):
        assert previous.finished_at is not None and current.started_at is not None
        assert current.started_at >= previous.finished_at, "two documents ran at once"


def test_a_restart_picks_up_jobs_left_queued_and_jobs_handed_back_at_stop(
    embedded_settings: Settings, lite_sessions: sessionmaker[Session], runtimes: list[EmbeddedRuntime]
) -> None:
    first = _start(embedded_settings, lite_sessions, runtimes)
    interrupted = _submit(first, lite_sessions, "Children play in the park", "documents", max_tokens=600,
                          ignore_eos=True)
    wait_generating(lite_sessions, interrupted)
    first.stop(grace_s=0.0)
    runtimes.remove(first)
    assert get_job(lite_sessions, interrupted).status == "queued"
    left_queued = add_job(lite_sessions, "Submitted while the service was down", max_tokens=4)

    _start(embedded_settings, lite_sessions, runtimes)
    done = wait_finished(lite_sessions, [interrupted, left_queued])

    assert [j.status for j in done] == ["succeeded", "succeeded"]
    assert done[0].attempts == 2 and done[0].completion_tokens == 600
    assert done[1].attempts == 1


def test_stop_gives_in_flight_jobs_the_configured_shutdown_grace(
    make_settings: Callable[..., Any], sqlite_url: str, worker_model_dir: Path,
    lite_sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings: Settings = make_settings(database_url=sqlite_url, model=str(worker_model_dir),
                                       worker_shutdown_grace_s=0.25)
    graces: list[float] = []
    real_shutdown = JobRunner.shutdown

    def recording_shutdown(self: JobRunner, grace_s: float, *args: Any, **kwargs: Any) -> list[str]:
        graces.append(grace_s)
        return real_shutdown(self, grace_s, *args, **kwargs)

    monkeypatch.setattr(JobRunner, "shutdown", recording_shutdown)
    runtime = EmbeddedRuntime(settings, sessions=lite_sessions)
    runtime.start()
    interrupted = _submit(runtime, lite_sessions, "Children play in the park", "documents",
                          max_tokens=LONG_JOB_TOKENS, ignore_eos=True)
    wait_generating(lite_sessions, interrupted)
    runtime.stop()
    assert graces == [0.25]
    assert get_job(lite_sessions, interrupted).status == "queued"  # handed back once the grace ran out


def _backlog_then_urgent(runtime: EmbeddedRuntime, sessions: sessionmaker[Session],
                         ) -> tuple[list[str], str, str]:
    """Eight documents due in an hour, then one due in two minutes, then one with priority -1."""
    backlog = [_submit(runtime, sessions, f"Document {i}: the river is calm", "documents", max_tokens=150,
                       ignore_eos=True, deadline_s=3600.0) for i in range(8)]
    due = _submit(runtime, sessions, "Due soon", "documents", max_tokens=8, deadline_s=120.0)
    first = _submit(runtime, sessions, "Urgent", "documents", max_tokens=8, priority=-1)
    return backlog, due, first


def _start_order(sessions: sessionmaker[Session], job_ids: list[str]) -> list[str]:
    done = wait_finished(sessions, job_ids)
    assert all(j.status == "succeeded" for j in done)
    return [j.id for j in sorted(done, key=lambda j: j.started_at)]  # type: ignore[arg-type, return-value]


def test_in_a_backlog_a_priority_job_starts_first_then_the_one_due_soonest(
    embedded_settings: Settings, lite_sessions: sessionmaker[Session], runtimes: list[EmbeddedRuntime]
) -> None:
    runtime = _start(embedded_settings, lite_sessions, runtimes)  # documents: one at a time
    backlog, due, first = _backlog_then_urgent(runtime, lite_sessions)
    order = _start_order(lite_sessions, [*backlog, due, first])
    # Whatever of the backlog had started before they arrived, then the priority job, then the deadline. On a
    # busy machine the feeder's first claim may come after the backlog and the deadline job were all queued:
    # then the deadline job goes first (least slack), and the priority job next, being submitted after.
    lead = min(order.index(first), order.index(due))
    assert lead <= 2 and set(order[lead:lead + 2]) == {first, due}, order
    if order[lead] == due:
        first_row, started = get_job(lite_sessions, first), get_job(lite_sessions, due).started_at
        assert started is not None and started < first_row.created_at, "it started before the priority job"
    assert order[lead + 2:] == [j for j in backlog if j in order[lead + 2:]]
    due_row = get_job(lite_sessions, due)
    assert due_row.finished_at is not None and due_row.deadline_at is not None
    assert due_row.finished_at <= due_row.deadline_at, "it finished within its deadline"
    # With its heartbeat, the worker publishes the pace it measured: submit predicts run times from it.
    wait_for(lambda: _published_pace(lite_sessions) is not None, "the worker's pace", timeout_s=10)
    pace = _published_pace(lite_sessions)
    assert pace is not None and pace.step_s > 0 and pace.prefill_token_s > 0


def _published_pace(sessions: sessionmaker[Session]) -> finish_times.Pace | None:
    with sessions() as session:
        return finish_times.queue_pace(session, lane("documents"), utcnow(), dead_after_s=60)


def test_flex_work_yields_to_every_other_job_of_its_queue(
    embedded_settings: Settings, lite_sessions: sessionmaker[Session], runtimes: list[EmbeddedRuntime]
) -> None:
    runtime = _start(embedded_settings, lite_sessions, runtimes)  # documents: one at a time
    running = _submit(runtime, lite_sessions, "Document 0: the river is calm", "documents", max_tokens=150,
                      ignore_eos=True)
    wait_generating(lite_sessions, running)
    flex = _submit(runtime, lite_sessions, "Spare capacity", "documents", max_tokens=4,
                   priority=TIER_PRIORITY["flex"])
    others = [_submit(runtime, lite_sessions, f"Document {i}", "documents", max_tokens=4) for i in (1, 2, 3)]
    assert _start_order(lite_sessions, [running, flex, *others]) == [running, *others, flex]


def test_scheduling_by_arrival_takes_the_backlog_in_order(
    embedded_settings: Settings, lite_sessions: sessionmaker[Session], runtimes: list[EmbeddedRuntime]
) -> None:
    settings = embedded_settings.model_copy(update={"scheduling": "arrival"})
    runtime = _start(settings, lite_sessions, runtimes)
    backlog, due, first = _backlog_then_urgent(runtime, lite_sessions)
    assert _start_order(lite_sessions, [*backlog, due, first]) == [*backlog, due, first]
