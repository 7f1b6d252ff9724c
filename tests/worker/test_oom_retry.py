"""A step that runs out of device memory is retried once on the same worker, under the same attempt: one
out-of-memory error and the job still succeeds (with the text a clean run gives); two and it fails with the
cause; any other engine error fails it at once. The model runner's forward is made to raise, as the GPU
would; JobRunner against Postgres and an in-process EngineHost on the tiny demo model."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.clock import utcnow
from conveyor.core.retry_policy import Backoff
from conveyor.engine.config import EngineConfig, RequestClassConfig
from conveyor.engine.host import EngineHost
from conveyor.engine.scheduled_chunk import ScheduledChunk
from conveyor.worker.job_runner import JobRunner
from tests.support.live_server import wait_for
from tests.support.worker import add_job, get_job


class FlakyForward:
    """The runner's execute, raising `error` on the next `failures` calls."""

    def __init__(self, execute: object) -> None:
        self._execute = execute
        self.failures = 0
        self.raised = 0
        self.error: Exception = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def __call__(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        if self.failures > 0:
            self.failures -= 1
            self.raised += 1
            raise self.error
        result: torch.Tensor = self._execute(chunks)  # type: ignore[operator]
        return result


@pytest.fixture(scope="module")
def host(worker_model_dir: Path) -> Iterator[EngineHost]:
    config = EngineConfig(
        model=str(worker_model_dir),
        max_num_seqs=4,
        max_model_len=256,
        num_kv_blocks=64,
        request_classes=[RequestClassConfig("interactive", max_running=4, priority=0)],
    )
    engine_host = EngineHost.from_config(config)
    yield engine_host
    engine_host.shutdown()


@pytest.fixture
def forward(host: EngineHost, monkeypatch: pytest.MonkeyPatch) -> FlakyForward:
    flaky = FlakyForward(host.engine.runner.execute)
    monkeypatch.setattr(host.engine.runner, "execute", flaky)
    return flaky


@pytest.fixture
def runner(host: EngineHost, sessions: sessionmaker[Session]) -> Iterator[JobRunner]:
    job_runner = JobRunner(host, sessions, "oom-worker", cancel_poll_s=0.05)
    job_runner.start()
    yield job_runner
    job_runner.shutdown(grace_s=0.0, publish=None)


def _run(runner: JobRunner, sessions: sessionmaker[Session], prompt: str, max_retries: int | None = 0,
         ) -> str:
    job_id = add_job(sessions, prompt, max_tokens=6, ignore_eos=True, max_retries=max_retries)
    assert runner.run(job_id, lambda: None)
    wait_for(lambda: get_job(sessions, job_id).status not in ("queued", "running"), "the job to end its run")
    wait_for(lambda: not runner.held_attempts(), "the runner to release the job")
    return job_id


def test_one_out_of_memory_step_is_retried_and_the_job_succeeds(
    runner: JobRunner,
    sessions: sessionmaker[Session],
    forward: FlakyForward,
) -> None:
    clean = get_job(sessions, _run(runner, sessions, "The river is calm"))
    forward.failures = 1
    retried = get_job(sessions, _run(runner, sessions, "The river is calm"))
    assert forward.raised == 1
    assert (retried.status, retried.attempts, retried.worker_id) == ("succeeded", 1, "oom-worker")
    assert retried.result_text == clean.result_text and retried.completion_tokens == 6


def test_a_second_out_of_memory_fails_the_job_with_its_cause(
    runner: JobRunner,
    sessions: sessionmaker[Session],
    forward: FlakyForward,
) -> None:
    forward.failures = 5
    job = get_job(sessions, _run(runner, sessions, "The river is calm"))
    assert forward.raised == 2  # the first try and its one retry
    assert (job.status, job.error_code, job.attempts) == ("failed", "out_of_memory", 1)
    assert "OutOfMemoryError" in (job.error_message or "")


def test_a_second_out_of_memory_with_retries_left_schedules_the_job_after_a_backoff(
    runner: JobRunner,
    sessions: sessionmaker[Session],
    forward: FlakyForward,
) -> None:
    forward.failures = 5
    before = utcnow()
    job = get_job(sessions, _run(runner, sessions, "The river is calm", max_retries=2))
    assert (job.status, job.retries, job.error_code, job.worker_id) == ("scheduled", 1, None, None)
    assert job.run_at is not None  # the first retry waits between half and all of the 2 s base
    assert before + timedelta(seconds=1) <= job.run_at <= utcnow() + timedelta(seconds=2)
    [failed] = job.history or []
    assert (failed["attempt"], failed["status"], failed["error"]["code"]) == (1, "failed", "out_of_memory")


def test_the_runners_backoff_sets_when_the_next_attempt_is_due(
    host: EngineHost, sessions: sessionmaker[Session], forward: FlakyForward,
) -> None:
    patient = JobRunner(host, sessions, "oom-worker", cancel_poll_s=0.05, backoff=Backoff(60, 60))
    patient.start()
    try:
        forward.failures = 5
        before = utcnow()
        job = get_job(sessions, _run(patient, sessions, "The river is calm", max_retries=1))
    finally:
        patient.shutdown(grace_s=0.0, publish=None)
    assert job.status == "scheduled" and job.run_at is not None
    assert before + timedelta(seconds=30) <= job.run_at <= utcnow() + timedelta(seconds=60)

def test_another_engine_error_is_not_retried(
    runner: JobRunner,
    sessions: sessionmaker[Session],
    forward: FlakyForward,
) -> None:
    forward.failures, forward.error = 5, RuntimeError("illegal memory access")
    job = get_job(sessions, _run(runner, sessions, "The river is calm"))
    assert forward.raised == 1
    assert (job.status, job.error_code) == ("failed", "engine_error")


def test_the_retry_keeps_the_tenants_cache_salt(
    runner: JobRunner,
    sessions: sessionmaker[Session],
    forward: FlakyForward,
) -> None:
    prompt = " ".join(f"step {i} of the plan" for i in range(12))  # several KV blocks
    forward.failures = 1
    retried = get_job(sessions, _run(runner, sessions, prompt))
    assert forward.raised == 1 and retried.status == "succeeded"
    again = get_job(sessions, _run(runner, sessions, prompt))
    assert again.cached_tokens is not None and again.cached_tokens >= 16, "the retry cached under the salt"
