"""Batches whose rounds keep failing, on Postgres and moto's S3 server: they back off (the state is in the
batch row, so it holds across runners and restarts) and, after a limit, end `failed` with an error naming the
cause and the outputs that can still be written; a transient failure followed by success still completes.

The jobs are completed in the store as a worker would (no engine here), and the runners are driven round by
round in a tight loop, harder than a worker's own loop would: spinning shows up as extra writes."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from botocore.exceptions import ClientError
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.clock import utcnow
from conveyor.core.lifecycle import OPEN_BATCH_STATUSES
from conveyor.core.s3 import make_s3_client
from conveyor.core.settings import Settings
from conveyor.core.store import batches, jobs, webhooks
from conveyor.core.store.tables import Batch, BatchLine
from conveyor.worker.batches.runner import BatchBackoff, BatchRunner

BACKOFF = BatchBackoff(first_delay_s=0.2, max_delay_s=0.8, max_failures=5)
BACKED_OFF_S = 0.2 + 0.4 + 0.8 + 0.8  # the waits between the five attempts
DRIVE_S = 30.0  # a hang guard, not a speed assertion
HOOK = "https://hooks.example.invalid/batches"  # never reached: the tests read the enqueued events
WRITES = ("put_object", "create_multipart_upload")


class CountingS3:
    """A boto3 client that counts output writes and fails the first `fail_first` of them."""

    def __init__(self, client: Any, fail_first: int = 0) -> None:
        self._client, self._fail_left = client, fail_first
        self.writes = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._client, name)
        if name not in WRITES:
            return method

        def write(**kwargs: Any) -> Any:
            with self._lock:
                self.writes += 1
                failing, self._fail_left = self._fail_left > 0, self._fail_left - 1
            if failing:
                raise ClientError({"Error": {"Code": "SlowDown", "Message": "reduce your rate"}}, name)
            return method(**kwargs)

        return write


def _settings(make_settings: Callable[..., Settings], pg_url: str, endpoint: str) -> Settings:
    return make_settings(database_url=pg_url, auth_enabled=False, s3_endpoint_url=endpoint,
                         s3_region="us-east-1", queues={"documents": {"max_running": 4}})


def _runner(sessions: sessionmaker[Session], settings: Settings, s3: Any, owner: str,
            backoff: BatchBackoff = BACKOFF, chunk_lines: int = 500) -> BatchRunner:
    def publish(job_id: str, queue: str) -> None:  # no broker: jobs are completed in the store below
        pass

    return BatchRunner(sessions, settings, publish, owner, tokenizer=None, s3=s3,
                       chunk_lines=chunk_lines, interval_s=0.0, backoff=backoff)


def _input(s3: Any, bucket: str, lines: int) -> str:
    key = f"in-{uuid.uuid4().hex[:8]}.jsonl"
    rows = ({"custom_id": f"c-{i}", "body": {"prompt": f"p {i}", "max_tokens": 2}} for i in range(lines))
    body = b"".join(json.dumps(row).encode() + b"\n" for row in rows)
    s3.put_object(Bucket=bucket, Key=key, Body=body)
    return f"s3://{bucket}/{key}"


def _create(sessions: sessionmaker[Session], input_url: str, output_url: str) -> str:
    with sessions() as session:
        return batches.create(session, tenant_id="default", input_url=input_url, output_url=output_url,
                              queue="documents", now=utcnow(), webhook={"url": HOOK}).id


def _get(sessions: sessionmaker[Session], batch_id: str) -> Batch:
    with sessions() as session:
        batch = batches.get(session, batch_id)
    assert batch is not None
    return batch


def _complete_queued_jobs(sessions: sessionmaker[Session], batch_id: str) -> int:
    """Plays the worker for every queued job of the batch."""
    with sessions() as session:
        ids = list(session.execute(select(BatchLine.job_id).where(
            BatchLine.batch_id == batch_id, BatchLine.status == "queued", BatchLine.job_id.is_not(None))
        ).scalars())
    for job_id in ids:
        with sessions() as session:
            job = jobs.claim(session, str(job_id), "worker-test", utcnow())
            if job is not None:
                jobs.complete(session, job.id, job.attempts, result_text="ok", finish_reason="stop",
                              prompt_tokens=2, completion_tokens=1, preemptions=0, first_token_at=utcnow(),
                              now=utcnow())
    return len(ids)


def _drive(runners: list[BatchRunner], sessions: sessionmaker[Session], batch_id: str,
           until: Callable[[Batch], bool] | None = None) -> Batch:
    """Rounds of every runner, about a hundred a second, completing the batch's jobs as they appear."""
    until = until or (lambda b: b.status not in OPEN_BATCH_STATUSES)
    deadline = time.monotonic() + DRIVE_S
    while time.monotonic() < deadline:
        for runner in runners:
            runner.run_once()
        _complete_queued_jobs(sessions, batch_id)
        batch = _get(sessions, batch_id)
        if until(batch):
            return batch
        time.sleep(0.01)
    raise AssertionError(f"batch {batch_id} still {_get(sessions, batch_id).status} after {DRIVE_S} s")


def _events(sessions: sessionmaker[Session], batch_id: str) -> list[str]:
    with sessions() as session:
        return [d.payload["type"] for d in webhooks.for_subject(session, "default", "batch", batch_id)
                if d.url == HOOK]


@pytest.fixture
def settings(make_settings: Callable[..., Settings], pg_url: str, moto_endpoint: str) -> Settings:
    return _settings(make_settings, pg_url, moto_endpoint)


@pytest.mark.parametrize("cause", ["NoSuchBucket", "NoCredentialsError"])
def test_a_cancelled_batch_with_unwritable_outputs_backs_off_then_fails(
    settings: Settings, sessions: sessionmaker[Session], s3: Any, bucket: str, moto_endpoint: str,
    monkeypatch: pytest.MonkeyPatch, cause: str,
) -> None:
    output = f"s3://missing-{uuid.uuid4().hex[:8]}/out/" if cause == "NoSuchBucket" else f"s3://{bucket}/out/"
    batch_id = _create(sessions, _input(s3, bucket, 3), output)
    with sessions() as session:
        assert batches.request_cancel(session, batch_id, "default", utcnow()) is not None
    if cause == "NoCredentialsError":  # the workers' credential chain finds nothing
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.delenv(name)
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    store = CountingS3(make_s3_client(moto_endpoint, "us-east-1"))
    first = _runner(sessions, settings, store, "runner-a")
    second = _runner(sessions, settings, store, "runner-b")  # another worker process

    first.run_once()
    after_one = _get(sessions, batch_id)
    assert (store.writes, after_one.status, after_one.failure_count) == (1, "cancelling", 1)
    assert after_one.next_attempt_at is not None and after_one.next_attempt_at > utcnow()
    _runner(sessions, settings, store, "runner-restarted").run_once()  # the backoff is in the row
    assert store.writes == 1

    started = time.monotonic()
    batch = _drive([first, second], sessions, batch_id)
    elapsed = time.monotonic() - started

    assert store.writes == BACKOFF.max_failures, "one write per attempt, no spinning"
    assert elapsed >= BACKED_OFF_S - 0.2 - 0.05  # the first wait had begun before `started`
    assert batch.status == "failed" and batch.finished_at is not None and batch.lease_owner is None
    assert batch.outputs is None
    assert batch.errors is not None and [e["code"] for e in batch.errors] == ["output_unwritable"]
    assert batch.errors[0]["message"].startswith(f"could not write outputs to {output}: {cause}")
    assert _events(sessions, batch_id) == ["batch.failed"]


def test_a_transient_write_failure_then_success_completes(
    settings: Settings, sessions: sessionmaker[Session], s3: Any, bucket: str, moto_endpoint: str,
) -> None:
    batch_id = _create(sessions, _input(s3, bucket, 3), f"s3://{bucket}/out/")
    store = CountingS3(make_s3_client(moto_endpoint, "us-east-1"), fail_first=2)

    started = time.monotonic()
    batch = _drive([_runner(sessions, settings, store, "runner-t")], sessions, batch_id)

    assert time.monotonic() - started >= 0.2 + 0.4  # each failed attempt waited out its backoff
    assert (batch.status, batch.completed, batch.failure_count, batch.next_attempt_at) == ("completed", 3, 0,
                                                                                           None)
    assert store.writes == 2 + 3  # two failed attempts, then results, errors and manifest
    results = s3.get_object(Bucket=bucket, Key="out/results.jsonl")["Body"].read().splitlines()
    assert [json.loads(line)["custom_id"] for line in results] == ["c-0", "c-1", "c-2"]
    assert _events(sessions, batch_id) == ["batch.completed"]


def test_a_batch_that_cannot_progress_fails_with_its_partial_outputs(
    settings: Settings, sessions: sessionmaker[Session], s3: Any, bucket: str, moto_endpoint: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batch_id = _create(sessions, _input(s3, bucket, 4), f"s3://{bucket}/out/")
    s3_client = make_s3_client(moto_endpoint, "us-east-1")
    runner = _runner(sessions, settings, s3_client, "runner-p", chunk_lines=2)
    _drive([runner], sessions, batch_id, until=lambda b: b.completed == 2)  # the first chunk ran

    def commit_chunk(*args: Any, **kwargs: Any) -> bool:
        raise RuntimeError("the store refuses chunks")

    monkeypatch.setattr(batches, "commit_chunk", commit_chunk)
    batch = _drive([runner], sessions, batch_id)

    assert batch.status == "failed" and (batch.total, batch.completed) == (2, 2)
    assert batch.errors is not None and [e["code"] for e in batch.errors] == ["processing_failed"]
    assert "RuntimeError" in batch.errors[0]["message"]
    manifest = json.loads(s3.get_object(Bucket=bucket, Key="out/manifest.json")["Body"].read())
    assert manifest["status"] == "failed" and manifest["request_counts"]["completed"] == 2
    results = s3.get_object(Bucket=bucket, Key="out/results.jsonl")["Body"].read().splitlines()
    assert [json.loads(line)["custom_id"] for line in results] == ["c-0", "c-1"]
    assert _events(sessions, batch_id) == ["batch.failed"]
