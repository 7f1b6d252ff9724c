from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from conveyor.core.s3 import S3Location
from conveyor.core.views.openai_objects import (
    GenerationResult,
    batch_error_line,
    batch_result_line,
    chat_completion,
    new_id,
    text_completion,
)
from conveyor.worker.batches.manifest import BatchManifest
from conveyor.worker.batches.writer import (
    MIN_PART_BYTES,
    JsonlWriter,
    LocalFileSink,
    S3ObjectSink,
    open_local_output,
    open_s3_output,
)

RESULT = GenerationResult(text="Hello!", finish_reason="stop", prompt_tokens=5, completion_tokens=2,
                          model="tiny", created=1_700_000_000)


def _exists(s3: Any, bucket: str, key: str) -> bool:
    try:
        s3.head_object(Bucket=bucket, Key=key)
    except ClientError as error:
        assert error.response["Error"]["Code"] in ("404", "NoSuchKey")
        return False
    return True


def test_openai_shapes() -> None:
    chat = chat_completion(RESULT, "chatcmpl-1")
    assert (chat["object"], chat["model"], chat["created"]) == ("chat.completion", "tiny", 1_700_000_000)
    assert chat["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello!"},
                                "logprobs": None, "finish_reason": "stop"}]
    assert chat["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    text = text_completion(RESULT, "cmpl-1")
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "Hello!"
    line = batch_result_line("a", chat, line_id="batch_req_1", request_id="req_1")
    assert line == {"id": "batch_req_1", "custom_id": "a", "error": None,
                    "response": {"status_code": 200, "request_id": "req_1", "body": chat}}
    error = batch_error_line(None, line=9, code="invalid_json", message="bad", line_id="batch_req_2")
    assert error == {"id": "batch_req_2", "custom_id": None, "response": None,
                     "error": {"code": "invalid_json", "message": "bad"}, "line": 9}
    assert new_id("batch_req_").startswith("batch_req_") and new_id("x") != new_id("x")
    with pytest.raises(ValueError, match="finish_reason"):
        chat_completion(GenerationResult("", "abort", 1, 0, "tiny", 0), "chatcmpl-2")


def test_manifest_counts_tokens_and_timings_round_trip() -> None:
    manifest = BatchManifest("batch_1", "s3://b/in.jsonl", "s3://b/out/", total=4, created_at=100.0,
                             started_at=102.5, finished_at=110.0)
    manifest.record_completed(5, 2)
    manifest.record_completed(3, 4)
    manifest.record_failed()
    manifest.record_cancelled()
    data = json.loads(manifest.to_json())
    assert data["request_counts"] == {"total": 4, "completed": 2, "failed": 1, "cancelled": 1}
    assert data["tokens"] == {"prompt": 8, "completion": 6, "total": 14}
    assert data["timings"]["queue_s"] == 2.5 and data["timings"]["run_s"] == 7.5
    assert data["timings"]["total_s"] == 10.0
    assert BatchManifest.from_dict(data) == manifest


def test_small_output_is_one_put_and_manifest_last(s3: Any, bucket: str) -> None:
    prefix = S3Location(bucket, "out/")
    manifest = BatchManifest("batch_1", "s3://x/in.jsonl", prefix.url, total=2)
    with open_s3_output(s3, prefix) as output:
        body = chat_completion(RESULT, "c1")
        output.write_result(batch_result_line("a", body, line_id="l1", request_id="r1"))
        output.write_error(batch_error_line("b", line=2, code="invalid_json", message="x", line_id="l2"))
        manifest.record_completed(5, 2)
        manifest.record_failed()
        locations = output.close(manifest)
    assert locations == {"results": f"s3://{bucket}/out/results.jsonl", "errors": f"s3://{bucket}/out/errors.jsonl",
                         "manifest": f"s3://{bucket}/out/manifest.json"}
    results = s3.get_object(Bucket=bucket, Key="out/results.jsonl")
    assert "-" not in results["ETag"]  # a single put_object, no multipart upload
    assert [json.loads(x)["custom_id"] for x in results["Body"].read().splitlines()] == ["a", "b"]
    errors = s3.get_object(Bucket=bucket, Key="out/errors.jsonl")["Body"].read().splitlines()
    assert [json.loads(x)["line"] for x in errors] == [2]
    stored = json.loads(s3.get_object(Bucket=bucket, Key="out/manifest.json")["Body"].read())
    assert stored["request_counts"]["completed"] == 1 and stored["request_counts"]["failed"] == 1


def test_large_output_uses_multipart_upload(s3: Any, bucket: str) -> None:
    location = S3Location(bucket, "out/results.jsonl")
    sink = S3ObjectSink(s3, location, part_bytes=MIN_PART_BYTES)
    body = chat_completion(GenerationResult("y" * 2000, "length", 10, 500, "tiny", 0), "c")
    count = 5500  # ~2.2 KB a line: ~12 MB, so two full parts and a smaller last one
    with JsonlWriter(sink) as writer:
        for i in range(count):
            writer.write(batch_result_line(f"req-{i}", body, line_id=f"l{i}", request_id=f"r{i}"))
        assert sink.parts_uploaded == 2
    head = s3.head_object(Bucket=bucket, Key=location.key)
    assert head["ETag"].strip('"').endswith("-3")
    stored = s3.get_object(Bucket=bucket, Key=location.key)["Body"].read()
    assert head["ContentLength"] == len(stored) > 2 * MIN_PART_BYTES
    ids = [json.loads(line)["custom_id"] for line in stored.splitlines()]
    assert ids == [f"req-{i}" for i in range(count)]


def test_failure_aborts_the_upload_and_leaves_no_object(s3: Any, bucket: str) -> None:
    prefix = S3Location(bucket, "out/")
    line = batch_error_line("a", line=1, code="x", message="m" * 1000, line_id="l")
    with pytest.raises(RuntimeError, match="worker failed"), open_s3_output(s3, prefix,
                                                                           part_bytes=MIN_PART_BYTES) as out:
        for _ in range(6000):  # > 5 MiB into each file: a multipart upload is under way for both
            out.write_error(line)
        assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads")
        raise RuntimeError("worker failed")
    assert not s3.list_multipart_uploads(Bucket=bucket).get("Uploads")
    assert "Contents" not in s3.list_objects_v2(Bucket=bucket, Prefix="out/")
    assert not _exists(s3, bucket, "out/results.jsonl")


class _AbortRefused:
    """An S3 client whose multipart aborts fail, as they do once the bucket or the credentials are gone."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def abort_multipart_upload(self, **kwargs: Any) -> None:
        raise ClientError({"Error": {"Code": "NoSuchBucket", "Message": "gone"}}, "AbortMultipartUpload")


def test_a_failing_abort_does_not_hide_the_error_that_led_to_it(s3: Any, bucket: str) -> None:
    location = S3Location(bucket, "out/results.jsonl")
    sink = S3ObjectSink(_AbortRefused(s3), location, part_bytes=MIN_PART_BYTES)
    with pytest.raises(RuntimeError, match="worker failed"), JsonlWriter(sink) as out:
        for _ in range(6000):  # > 5 MiB: a multipart upload is under way
            out.write({"line": "m" * 1000})
        assert sink.parts_uploaded == 1
        raise RuntimeError("worker failed")
    sink.abort()  # nothing left to abort: a no-op
    for upload in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []):  # tidy the bucket
        s3.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])


def test_part_size_below_s3_minimum_is_refused(s3: Any) -> None:
    with pytest.raises(ValueError, match="part_bytes"):
        S3ObjectSink(s3, S3Location("any-bucket", "k"), part_bytes=1024)


def test_a_line_with_a_lone_surrogate_keeps_its_escape(tmp_path: Path) -> None:
    with JsonlWriter(LocalFileSink(tmp_path / "out.jsonl")) as out:
        out.write({"custom_id": "\udfff", "text": "café"})
        out.write({"custom_id": "ok", "text": "café"})
    first, second = (tmp_path / "out.jsonl").read_bytes().splitlines()
    assert first == b'{"custom_id":"\\udfff","text":"caf\\u00e9"}'  # JSON escapes, valid UTF-8
    assert json.loads(first)["custom_id"] == "\udfff"
    assert second == '{"custom_id":"ok","text":"café"}'.encode()


def test_local_folder_output(tmp_path: Path) -> None:
    folder = tmp_path / "batch_1"
    with open_local_output(folder) as output:
        output.write_result(batch_result_line("a", text_completion(RESULT, "c"), line_id="l", request_id="r"))
        output.write_error(batch_error_line(None, line=2, code="invalid_json", message="x", line_id="l2"))
        assert not (folder / "results.jsonl").exists()  # only the .partial file until close
        output.close(BatchManifest("batch_1", "file-1", str(folder), total=2))
    assert sorted(p.name for p in folder.iterdir()) == ["errors.jsonl", "manifest.json", "results.jsonl"]
    results = [json.loads(x) for x in (folder / "results.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["a", None]
    assert results[0]["response"]["body"]["choices"][0]["text"] == "Hello!"
    assert json.loads((folder / "manifest.json").read_text())["request_counts"]["total"] == 2


def test_local_folder_output_aborted(tmp_path: Path) -> None:
    folder = tmp_path / "batch_2"
    with pytest.raises(RuntimeError), open_local_output(folder) as output:
        output.write_result({"custom_id": "a"})
        raise RuntimeError("boom")
    assert list(folder.iterdir()) == []
