"""Jobs on a speculating engine (JobRunner, Postgres, an in-process EngineHost on the tiny demo model): a job
stores the tokens drafted for it and those accepted, a job that asked `speculate: false` drafts none, and
both answer the same greedy text (speculation never changes the output)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from conveyor.engine.config import EngineConfig, RequestClassConfig
from conveyor.engine.host import EngineHost
from conveyor.worker.job_runner import JobRunner
from tests.support.worker import add_job, get_job

PROMPT = "The queue holds jobs. The queue holds jobs. The queue holds jobs."
# Every step drafts (no step-cost model, no giving up on a low acceptance): the random weights accept few.
SPECULATIVE = {"method": "ngram", "min_ngram": 1, "dynamic": False, "min_acceptance_rate": 0.0}


@pytest.fixture(scope="module")
def host(worker_model_dir: Path) -> Iterator[EngineHost]:
    config = EngineConfig(model=str(worker_model_dir), max_num_seqs=4, num_kv_blocks=64, max_model_len=256,
                          request_classes=[RequestClassConfig("interactive", max_running=4, priority=0)],
                          speculative=SPECULATIVE)
    engine_host = EngineHost.from_config(config)
    yield engine_host
    engine_host.shutdown()


@pytest.fixture
def runner(host: EngineHost, sessions: sessionmaker[Session]) -> Iterator[JobRunner]:
    job_runner = JobRunner(host, sessions, "speculating-worker", cancel_poll_s=0.05)
    job_runner.start()
    yield job_runner
    job_runner.shutdown(grace_s=0.0, publish=None)


def run(runner: JobRunner, job_id: str) -> None:
    done = threading.Event()
    assert runner.run(job_id, done.set)
    assert done.wait(60), f"job {job_id} never finished"


def test_a_job_keeps_its_drafted_and_accepted_tokens_and_may_opt_out(
    runner: JobRunner, sessions: sessionmaker[Session]
) -> None:
    speculated = add_job(sessions, PROMPT, max_tokens=40, ignore_eos=True)
    opted_out = add_job(sessions, PROMPT, max_tokens=40, ignore_eos=True, speculate=False)
    for job_id in (speculated, opted_out):
        run(runner, job_id)
    drafted, plain = get_job(sessions, speculated), get_job(sessions, opted_out)
    assert drafted.status == plain.status == "succeeded"
    assert drafted.draft_tokens is not None and drafted.draft_tokens > 0
    assert drafted.accepted_draft_tokens is not None
    assert 0 <= drafted.accepted_draft_tokens <= drafted.draft_tokens
    assert (plain.draft_tokens, plain.accepted_draft_tokens) == (0, 0)
    assert drafted.result_text == plain.result_text
    assert drafted.completion_tokens == plain.completion_tokens == 40
