"""Embedding jobs on a worker: JobRunner against Postgres and an in-process EngineHost on a tiny BERT
sentence-transformers folder. A request per input, gathered as choices are; the vectors stored in input
order (what sentence-transformers computes), usage the tokens embedded; one out-of-memory step retried as
for generation; what the engine refuses (an input too long, an embedding job on a generation engine) fails
the job `invalid_request` with the engine's reason."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.clock import utcnow
from conveyor.core.protocol.job_kinds import EMBEDDING
from conveyor.core.store import jobs
from conveyor.core.store.tables import Job
from conveyor.core.views.embedding_vectors import decode_vector
from conveyor.engine.config import EngineConfig, RequestClassConfig
from conveyor.engine.host import EngineHost
from conveyor.worker.job_runner import JobRunner
from tests.support.encoder_models import build_encoder_st_folder
from tests.support.live_server import wait_for
from tests.support.worker import add_job, get_job, lane, wait_finished

TEXTS = ["hello", "The queue holds jobs until a worker is free.", "one more, of another length"]
MAX_SEQ_LENGTH = 32


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_encoder_st_folder(tmp_path_factory.mktemp("bert") / "bert", max_seq_length=MAX_SEQ_LENGTH)


def host_of(folder: Path) -> EngineHost:
    config = EngineConfig(model=str(folder), max_num_seqs=4, max_model_len=256, num_kv_blocks=64,
                          dtype="float32", device="cpu", attention_backend="torch",
                          request_classes=[RequestClassConfig("interactive", max_running=4, priority=0)])
    return EngineHost.from_config(config)


@pytest.fixture(scope="module")
def host(bert_dir: Path) -> Iterator[EngineHost]:
    engine_host = host_of(bert_dir)
    yield engine_host
    engine_host.shutdown()


def runner_of(host: EngineHost, sessions: sessionmaker[Session]) -> JobRunner:
    job_runner = JobRunner(host, sessions, "embedding-worker", cancel_poll_s=0.05)
    job_runner.start()
    return job_runner


@pytest.fixture
def runner(host: EngineHost, sessions: sessionmaker[Session]) -> Iterator[JobRunner]:
    job_runner = runner_of(host, sessions)
    yield job_runner
    job_runner.shutdown(grace_s=0.0, publish=None)


def add_embedding_job(sessions: sessionmaker[Session], inputs: list[Any], max_retries: int | None = None,
                      **params: Any) -> str:
    """An embedding job as the API inserts it (core/protocol/embedding_request.py job_params)."""
    new = jobs.NewJob(tenant_id="default", queue=lane("interactive"), prompt=None, messages=None,
                      params={"max_tokens": 0, **params}, meta=None, webhook=None, idempotency_key=None,
                      request_hash="test", prompt_tokens=0, ttl_s=None, timeout_s=None, kind=EMBEDDING,
                      inputs=inputs, max_retries=max_retries)
    with sessions() as session:
        return jobs.add(session, new, utcnow()).id


def run(runner: JobRunner, sessions: sessionmaker[Session], job_id: str) -> Job:
    assert runner.run(job_id, lambda: None)
    [job] = wait_finished(sessions, [job_id])
    wait_for(lambda: not runner.held_attempts(), "the runner to release the job")
    return job


def oracle(folder: Path, texts: list[str]) -> tuple[np.ndarray, list[int]]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    lengths = [int(mask.sum()) for mask in model.tokenize(texts)["attention_mask"]]
    return np.asarray(model.encode(texts, normalize_embeddings=True)), lengths


def test_each_input_gets_its_vector_in_order(runner: JobRunner, sessions: sessionmaker[Session],
                                             bert_dir: Path) -> None:
    job = run(runner, sessions, add_embedding_job(sessions, TEXTS))
    assert (job.status, job.kind, job.result_text, job.finish_reason) == ("succeeded", "embedding", None,
                                                                          "stop")
    want, lengths = oracle(bert_dir, TEXTS)
    assert job.embeddings is not None
    got = np.asarray([decode_vector(vector) for vector in job.embeddings])
    assert np.abs(got - want).max() < 1e-4
    assert (job.prompt_tokens, job.completion_tokens, job.attempts) == (sum(lengths), 0, 1)

    one = run(runner, sessions, add_embedding_job(sessions, [TEXTS[1]], dimensions=8))
    assert one.embeddings is not None and len(decode_vector(one.embeddings[0])) == 8


class FlakyForward:
    """The runner's execute, raising an out-of-memory error on the next `failures` calls."""

    def __init__(self, execute: Any) -> None:
        self._execute, self.failures, self.raised = execute, 0, 0

    def __call__(self, chunks: Any) -> Any:
        if self.failures > 0:
            self.failures, self.raised = self.failures - 1, self.raised + 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self._execute(chunks)


def test_an_out_of_memory_step_is_retried_once(runner: JobRunner, sessions: sessionmaker[Session],
                                               host: EngineHost, monkeypatch: pytest.MonkeyPatch) -> None:
    clean = run(runner, sessions, add_embedding_job(sessions, TEXTS))
    flaky = FlakyForward(host.engine.runner.execute)
    monkeypatch.setattr(host.engine.runner, "execute", flaky)
    flaky.failures = 1
    retried = run(runner, sessions, add_embedding_job(sessions, TEXTS))
    assert flaky.raised == 1 and (retried.status, retried.attempts) == ("succeeded", 1)
    assert retried.embeddings is not None and clean.embeddings is not None
    assert np.allclose([decode_vector(v) for v in retried.embeddings],
                       [decode_vector(v) for v in clean.embeddings], atol=1e-5)
    flaky.failures = 100  # every step from now on (the engine also runs a failed step's requests apart)
    failed = run(runner, sessions, add_embedding_job(sessions, TEXTS, max_retries=0))  # no later retry
    assert (failed.status, failed.error_code, failed.attempts) == ("failed", "out_of_memory", 1)
    assert "OutOfMemoryError" in (failed.error_message or "")


def test_what_the_engine_refuses_fails_the_job_with_its_reason(runner: JobRunner,
                                                               sessions: sessionmaker[Session]) -> None:
    too_long = run(runner, sessions, add_embedding_job(sessions, ["fine", [5] * (MAX_SEQ_LENGTH + 1)]))
    assert (too_long.status, too_long.error_code) == ("failed", "invalid_request")
    assert str(MAX_SEQ_LENGTH) in (too_long.error_message or "")
    cut = run(runner, sessions, add_embedding_job(sessions, [[5] * (MAX_SEQ_LENGTH + 1)], truncate=True))
    assert (cut.status, cut.prompt_tokens) == ("succeeded", MAX_SEQ_LENGTH)
    text_job = get_job(sessions, add_job(sessions, "a prompt", max_tokens=2))
    refused = run(runner, sessions, text_job.id)
    assert (refused.status, refused.error_code) == ("failed", "invalid_request")
    assert "serves embeddings" in (refused.error_message or "")


def test_a_generation_engine_refuses_an_embedding_job(sessions: sessionmaker[Session],
                                                      worker_model_dir: Path) -> None:
    generation = host_of(worker_model_dir)
    job_runner = runner_of(generation, sessions)
    try:
        job = run(job_runner, sessions, add_embedding_job(sessions, TEXTS))
    finally:
        job_runner.shutdown(grace_s=0.0, publish=None)
        generation.shutdown()
    assert (job.status, job.error_code) == ("failed", "invalid_request")
    assert "generates text" in (job.error_message or "")
