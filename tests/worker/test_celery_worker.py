"""The Celery worker end to end: a real `python -m conveyor.worker` subprocess, real Redis and Postgres, the
real engine on the tiny demo model (fp32, CPU). A worker killed (SIGKILL) or stopped (SIGTERM) with jobs in
flight is the fault suite's part (tests/faults/test_fault_workers.py), under traffic and with a second
worker."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.seams.broker import BrokerPublisher
from conveyor.core.seams.dispatch import publish_and_mark
from conveyor.core.settings import Settings
from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from tests.support.live_server import SpareRedis
from tests.support.worker import (
    LONG_JOB_TOKENS,
    WorkerProcesses,
    add_job,
    get_job,
    lane,
    wait_finished,
    wait_generating,
    worker_env,
)


def _submit(
    sessions: sessionmaker[Session], publisher: BrokerPublisher, prompt: str | None, queue: str, **kwargs: Any
) -> str:
    """What the API does: commit the job, publish its id, mark it dispatched."""
    job_id = add_job(sessions, prompt, queue, **kwargs)
    assert publish_and_mark(sessions, publisher.publish, [(job_id, lane(queue))]) == 1
    return job_id


def test_jobs_in_both_queues_complete_and_greedy_text_matches_offline_engine(
    pg_url: str, redis_url: str, sessions: sessionmaker[Session], worker_model_dir: Path,
    worker_procs: WorkerProcesses, tmp_path: Path,
) -> None:
    publisher = BrokerPublisher(
        Settings(database_url=pg_url, broker_url=redis_url, model=str(worker_model_dir)))
    worker_procs.start(worker_env(pg_url, redis_url, worker_model_dir, tmp_path))
    prompt = "The scheduler gives every running request"
    interactive = _submit(sessions, publisher, prompt, "interactive", max_tokens=24)
    document = _submit(sessions, publisher, "A block table maps logical blocks", "documents", max_tokens=40)
    chat = _submit(sessions, publisher, None, "interactive", messages=[{"role": "user", "content": "Hello"}],
                   max_tokens=12)

    done = wait_finished(sessions, [interactive, document, chat])

    assert [j.status for j in done] == ["succeeded"] * 3, [(j.error_code, j.error_message) for j in done]
    assert [j.attempts for j in done] == [1, 1, 1]
    offline = LLM(str(worker_model_dir), max_num_seqs=4, num_kv_blocks=512)
    expected = offline.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert done[0].result_text == expected.text
    assert done[0].completion_tokens == len(expected.token_ids)
    assert done[0].prompt_tokens == len(expected.prompt_token_ids)
    expected_chat = offline.chat([{"role": "user", "content": "Hello"}],
                                 SamplingParams(max_tokens=12, temperature=0.0))
    assert done[2].result_text == expected_chat[0].text
    for job in done:
        assert job.started_at is not None and job.first_token_at is not None and job.finished_at is not None
        assert job.created_at <= job.started_at <= job.first_token_at <= job.finished_at


def test_documents_held_to_their_limit_while_interactive_jobs_pass(
    pg_url: str, redis_url: str, sessions: sessionmaker[Session], worker_model_dir: Path,
    worker_procs: WorkerProcesses, tmp_path: Path,
) -> None:
    publisher = BrokerPublisher(
        Settings(database_url=pg_url, broker_url=redis_url, model=str(worker_model_dir)))
    worker_procs.start(worker_env(pg_url, redis_url, worker_model_dir, tmp_path,
                                  QUEUES__DOCUMENTS__MAX_RUNNING="1"))
    docs = [_submit(sessions, publisher, f"Document {i}: the river is calm", "documents", max_tokens=150,
                    ignore_eos=True) for i in range(10)]
    interactive = _submit(sessions, publisher, "Good morning!", "interactive", max_tokens=8)

    done = wait_finished(sessions, [*docs, interactive])

    assert all(j.status == "succeeded" for j in done)
    doc_rows, chat_row = done[:-1], done[-1]
    assert chat_row.finished_at is not None
    still_queued = [d for d in doc_rows if d.started_at is not None and d.started_at > chat_row.finished_at]
    assert still_queued, "the interactive job should finish while documents are still queued"
    by_start = sorted(doc_rows, key=lambda d: d.started_at)  # type: ignore[arg-type, return-value]
    for previous, current in itertools.pairwise(by_start):
        assert previous.finished_at is not None and current.started_at is not None
        assert current.started_at >= previous.finished_at, "two documents ran at once"


def test_jobs_accepted_while_the_broker_is_down_run_once_it_is_back(
    pg_url: str, sessions: sessionmaker[Session], worker_model_dir: Path, worker_procs: WorkerProcesses,
    tmp_path: Path, spare_redis: SpareRedis,
) -> None:
    spare_redis.start()
    publisher = BrokerPublisher(
        Settings(database_url=pg_url, broker_url=spare_redis.url, model=str(worker_model_dir)))
    worker_procs.start(worker_env(pg_url, spare_redis.url, worker_model_dir, tmp_path,
                                  QUEUES__DOCUMENTS__MAX_RUNNING="1"))
    running_doc = _submit(sessions, publisher, "A long document", "documents", max_tokens=LONG_JOB_TOKENS,
                          ignore_eos=True)
    wait_generating(sessions, running_doc)

    spare_redis.stop()  # the broker goes down (and loses everything: no persistence) under a busy worker
    assert not publisher.ping()
    accepted = [add_job(sessions, f"Job {i} while the broker is down", max_tokens=6) for i in range(3)]
    accepted.append(add_job(sessions, "Another document", "documents", max_tokens=6))
    for job_id in accepted:  # what the API does: publishing fails, the job stays queued and undispatched
        queue = get_job(sessions, job_id).queue
        assert publish_and_mark(sessions, publisher.publish, [(job_id, queue)]) == 0
    assert all(get_job(sessions, j).dispatched_at is None for j in accepted)

    spare_redis.start()
    done = wait_finished(sessions, [running_doc, *accepted], timeout_s=90)

    assert [j.status for j in done] == ["succeeded"] * 5
    assert [j.attempts for j in done] == [1] * 5
    first_doc, second_doc = done[0], done[-1]
    assert first_doc.finished_at is not None and second_doc.started_at is not None
    # The reconnected channel's window is fresh, but the document still running counts against the limit.
    assert second_doc.started_at >= first_doc.finished_at
    log = worker_procs.log(0)  # the reconnect path is clean: no ack on a dead channel, no failed restart
    assert "ack failed" not in log and "Error on restarting" not in log, log[-4000:]


def test_in_a_backlog_a_priority_job_starts_first_then_the_one_due_soonest(
    pg_url: str, redis_url: str, sessions: sessionmaker[Session], worker_model_dir: Path,
    worker_procs: WorkerProcesses, tmp_path: Path,
) -> None:
    """On PostgreSQL and Redis, as embedded (tests/worker/test_embedded.py): the fleet's claims take a
    queue's jobs by priority, then by a deadline still ahead."""
    publisher = BrokerPublisher(
        Settings(database_url=pg_url, broker_url=redis_url, model=str(worker_model_dir)))
    worker_procs.start(worker_env(pg_url, redis_url, worker_model_dir, tmp_path,
                                  QUEUES__DOCUMENTS__MAX_RUNNING="1"))
    backlog = [_submit(sessions, publisher, f"Document {i}: the river is calm", "documents", max_tokens=150,
                       ignore_eos=True, deadline_s=3600.0) for i in range(8)]
    due = _submit(sessions, publisher, "Due soon", "documents", max_tokens=8, deadline_s=300.0)
    first = _submit(sessions, publisher, "Urgent", "documents", max_tokens=8, priority=-1)
    done = wait_finished(sessions, [*backlog, due, first])
    assert all(j.status == "succeeded" for j in done)
    order = [j.id for j in sorted(done, key=lambda j: j.started_at)]  # type: ignore[arg-type, return-value]
    assert order.index(first) <= 2 and order.index(due) == order.index(first) + 1, order
    due_row = get_job(sessions, due)
    assert due_row.finished_at is not None and due_row.deadline_at is not None
    assert due_row.finished_at <= due_row.deadline_at
