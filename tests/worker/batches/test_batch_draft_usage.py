"""A batch's output lines carry each job's speculative decoding figures as OpenAI names a predicted output's
tokens (usage.completion_tokens_details), and only for the lines whose jobs had drafts. On Postgres and
moto's S3 server; the jobs are completed in the store as a worker whose engine speculated would."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.clock import utcnow
from conveyor.core.lifecycle import OPEN_BATCH_STATUSES
from conveyor.core.settings import Settings
from conveyor.core.store import batches, jobs
from conveyor.core.store.tables import BatchLine
from conveyor.worker.batches.runner import BatchRunner

DRIVE_S = 30.0  # a hang guard, not a speed assertion
DRAFTS = {"drafted": (12, 9), "plain": (0, 0)}  # custom_id -> (drafted, accepted) of its job


def _complete_with_drafts(sessions: sessionmaker[Session], batch_id: str) -> None:
    """Plays the worker for every queued job of the batch, with its line's drafts."""
    with sessions() as session:
        queued = session.execute(select(BatchLine.custom_id, BatchLine.job_id).where(
            BatchLine.batch_id == batch_id, BatchLine.status == "queued", BatchLine.job_id.is_not(None),
        )).all()
    for custom_id, job_id in queued:
        drafted, accepted = DRAFTS[str(custom_id)]
        with sessions() as session:
            job = jobs.claim(session, str(job_id), "speculating-worker", utcnow())
            assert job is not None
            jobs.complete(session, job.id, job.attempts, result_text="ok", finish_reason="stop",
                          prompt_tokens=2, completion_tokens=11, preemptions=0, first_token_at=utcnow(),
                          now=utcnow(), draft_tokens=drafted, accepted_draft_tokens=accepted)


def _status(sessions: sessionmaker[Session], batch_id: str) -> str:
    with sessions() as session:
        batch = batches.get(session, batch_id)
    assert batch is not None
    return batch.status


def test_each_output_line_shows_its_jobs_accepted_and_rejected_drafts(
    make_settings: Callable[..., Settings], pg_url: str, moto_endpoint: str, sessions: sessionmaker[Session],
    s3: Any, bucket: str,
) -> None:
    settings = make_settings(database_url=pg_url, auth_enabled=False, s3_endpoint_url=moto_endpoint,
                             s3_region="us-east-1")
    key = f"in-{uuid.uuid4().hex[:8]}.jsonl"
    lines = [{"custom_id": custom_id, "body": {"prompt": "p", "max_tokens": 11}} for custom_id in DRAFTS]
    s3.put_object(Bucket=bucket, Key=key, Body=b"".join(json.dumps(line).encode() + b"\n" for line in lines))
    with sessions() as session:
        batch_id = batches.create(session, tenant_id="default", input_url=f"s3://{bucket}/{key}",
                                  output_url=f"s3://{bucket}/out/", queue="documents", now=utcnow()).id
    runner = BatchRunner(sessions, settings, lambda job_id, queue: None, "runner-d", tokenizer=None, s3=s3,
                         interval_s=0.0)
    deadline = time.monotonic() + DRIVE_S
    while _status(sessions, batch_id) in OPEN_BATCH_STATUSES:
        assert time.monotonic() < deadline, f"batch {batch_id} never finished"
        runner.run_once()
        _complete_with_drafts(sessions, batch_id)

    results = s3.get_object(Bucket=bucket, Key="out/results.jsonl")["Body"].read().splitlines()
    usage = {line["custom_id"]: line["response"]["body"]["usage"] for line in map(json.loads, results)}
    assert usage["drafted"]["completion_tokens_details"] == {"accepted_prediction_tokens": 9,
                                                             "rejected_prediction_tokens": 3}
    assert usage["drafted"]["completion_tokens"] == 11
    assert "completion_tokens_details" not in usage["plain"]
