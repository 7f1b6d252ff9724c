"""DELETE /v1/jobs/{id}, /v1/files/{id} and /v1/batches/{id}: each then reads as 404, its rows are gone from
the store (webhook deliveries and their attempts with it) and its blobs from the file store (a local folder,
or the moto S3 bucket); another tenant's id is a 404; what is still queued, running or read is refused (409).
Runs on SQLite and on PostgreSQL."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError
from openai.types import FileDeleted
from sqlalchemy import update
from test_files_batches_http import moto_url, s3  # noqa: F401 (the shared moto server and bucket)

from conveyor.core.clock import utcnow
from conveyor.core.lifecycle import IN_PROGRESS
from conveyor.core.store import batches
from conveyor.core.store.tables import Batch, BatchLine, File, Job
from tests.support.deletion import attempts_of, count, deliveries_of, delivery, ended_batch, finished_job
from tests.support.service import Service, error_of

BUCKET = "conveyor-batches"  # the bucket the shared `s3` fixture creates


def test_a_finished_job_is_deleted_with_its_deliveries(service: Service) -> None:
    alice, bob = service.client("alice"), service.client("bob")
    queued = alice.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 2})
    assert queued.status_code == 202, queued.text
    refused = alice.delete(f"/v1/jobs/{queued.json()['id']}")
    assert refused.status_code == 409 and "cancel it first" in error_of(refused)["message"], refused.text

    with service.session_factory() as session:
        job_id = finished_job(session, "alice", utcnow())
        delivery_id = delivery(session, "alice", "job", job_id, utcnow())
    assert bob.delete(f"/v1/jobs/{job_id}").status_code == 404  # another tenant's id
    deleted = alice.delete(f"/v1/jobs/{job_id}")
    assert deleted.status_code == 200 and deleted.json() == {"id": job_id, "object": "job", "deleted": True}
    assert alice.get(f"/v1/jobs/{job_id}").status_code == 404
    assert alice.delete(f"/v1/jobs/{job_id}").status_code == 404
    with service.session_factory() as session:
        assert count(session, Job, Job.id == job_id) == 0
        assert deliveries_of(session, [job_id]) == 0 and attempts_of(session, [delivery_id]) == 0
        assert count(session, Job, Job.id == queued.json()["id"]) == 1  # the refused one is untouched


def test_a_file_and_its_s3_blob_are_deleted(
    make_service: Callable[..., Service], moto_url: str, s3: Any  # noqa: F811 (imported fixtures)
) -> None:
    service = make_service(
        files_url=f"s3://{BUCKET}/uploads", s3_endpoint_url=moto_url, s3_region="us-east-1"
    )
    alice, bob = service.client("alice"), service.client("bob")
    uploaded = alice.post(
        "/v1/files", files={"file": ("in.jsonl", io.BytesIO(b"{}\n"))}, data={"purpose": "batch"}
    ).json()
    file_id, key = uploaded["id"], f"uploads/{uploaded['id']}"
    assert s3.get_object(Bucket=BUCKET, Key=key)["Body"].read() == b"{}\n"
    batch = alice.post(
        "/v1/batches",
        json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    ).json()
    busy = alice.delete(f"/v1/files/{file_id}")
    assert busy.status_code == 409 and batch["id"] in error_of(busy)["message"], busy.text

    with service.session_factory() as session:
        session.execute(update(Batch).where(Batch.id == batch["id"]).values(status="completed"))
        session.commit()
    assert bob.delete(f"/v1/files/{file_id}").status_code == 404
    deleted = alice.delete(f"/v1/files/{file_id}")
    assert deleted.status_code == 200, deleted.text
    assert FileDeleted.model_validate(deleted.json()) == FileDeleted(id=file_id, object="file", deleted=True)
    assert alice.get(f"/v1/files/{file_id}").status_code == 404
    assert alice.get(f"/v1/files/{file_id}/content").status_code == 404
    with pytest.raises(ClientError):
        s3.head_object(Bucket=BUCKET, Key=key)
    with service.session_factory() as session:
        assert count(session, File, File.id == file_id) == 0


def test_an_ended_batch_goes_with_its_lines_jobs_files_and_deliveries(
    make_service: Callable[..., Service],
) -> None:
    service = make_service(purge_chunk_rows=1)  # one line per transaction: the chunked path
    alice, bob = service.client("alice"), service.client("bob")
    with service.session_factory() as session:
        seeded = ended_batch(session, service.settings, "alice", utcnow(), lines=3)
        job_delivery = delivery(session, "alice", "job", seeded.job_ids[0], utcnow())
        session.execute(update(Batch).where(Batch.id == seeded.id).values(status=IN_PROGRESS))
        session.commit()
    open_batch = alice.delete(f"/v1/batches/{seeded.id}")
    assert open_batch.status_code == 409 and "in_progress" in error_of(open_batch)["message"], open_batch.text
    held_job = alice.delete(f"/v1/jobs/{seeded.job_ids[0]}")  # an open batch still needs its jobs
    assert held_job.status_code == 409 and seeded.id in error_of(held_job)["message"], held_job.text

    with service.session_factory() as session:
        session.execute(update(Batch).where(Batch.id == seeded.id).values(status="completed"))
        session.commit()
    assert bob.delete(f"/v1/batches/{seeded.id}").status_code == 404
    deleted = alice.delete(f"/v1/batches/{seeded.id}")
    assert deleted.status_code == 200 and deleted.json() == {
        "id": seeded.id,
        "object": "batch",
        "deleted": True,
    }
    assert alice.get(f"/v1/batches/{seeded.id}").status_code == 404
    for file in (seeded.output, seeded.error):
        assert alice.get(f"/v1/files/{file.id}").status_code == 404
        assert not Path(file.url).exists()
    with service.session_factory() as session:
        assert batches.get(session, seeded.id) is None
        assert count(session, BatchLine, BatchLine.batch_id == seeded.id) == 0
        assert count(session, Job, Job.id.in_(seeded.job_ids)) == 0
        assert count(session, File, File.id.in_([seeded.output.id, seeded.error.id])) == 0
        assert deliveries_of(session, [seeded.id, *seeded.job_ids]) == 0
        assert attempts_of(session, [job_delivery]) == 0
