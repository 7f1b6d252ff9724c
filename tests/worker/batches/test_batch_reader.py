from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError, ResponseStreamingError

from conveyor.core.s3 import S3Location
from conveyor.worker.batches.reader import (
    LineStream,
    OversizeLine,
    ReadPosition,
    open_local_lines,
    open_s3_lines,
    skip_to_line,
)

MiB = 1024 * 1024


def _lines(chunks: list[bytes], max_line_bytes: int = 100) -> list[tuple[int, Any]]:
    return list(LineStream(iter(chunks), ReadPosition(), max_line_bytes))


def test_lines_split_across_chunks_bom_crlf_blank_and_last_line_without_newline() -> None:
    assert _lines([b'\xef\xbb\xbf{"a"', b':1}\n{"b":', b"2}\r\n", b"\n", b'{"c":3}']) == [
        (1, b'{"a":1}'), (2, b'{"b":2}'), (4, b'{"c":3}')]  # the blank line 3 is counted, not yielded


def test_oversize_line_is_reported_and_skipped_with_bounded_buffer() -> None:
    lines = _lines([b"ok\n", b"x" * 60, b"x" * 60, b"x" * 60, b"\nfine\n", b"y" * 200], max_line_bytes=100)
    assert lines == [(1, b"ok"), (2, OversizeLine(100)), (3, b"fine"), (4, OversizeLine(100))]


def test_position_after_each_line_is_the_next_line_start(tmp_path: Path) -> None:
    data = b'{"a":1}\n\n{"bb":2}\r\n{"ccc":3}'
    path = tmp_path / "in.jsonl"
    path.write_bytes(data)
    with open_local_lines(path, chunk_bytes=3) as lines:
        positions = [(number, lines.position) for number, _ in lines]
    assert positions == [(1, ReadPosition(2, 8)), (3, ReadPosition(4, 19)), (4, ReadPosition(5, len(data)))]
    assert data[8:].startswith(b"\n{\"bb\"") and data[19:] == b'{"ccc":3}'


def _jsonl(count: int) -> bytes:
    return b"".join(json.dumps({"custom_id": f"req-{i}", "body": {"prompt": "p" * (i % 7)}}).encode() + b"\n"
                    for i in range(1, count + 1))


def test_s3_resume_from_byte_offset_matches_a_full_read(s3: Any, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="in.jsonl", Body=_jsonl(1000))
    location = S3Location(bucket, "in.jsonl")
    with open_s3_lines(s3, location, chunk_bytes=4096) as lines:
        full = list(lines)
    with open_s3_lines(s3, location, chunk_bytes=4096) as lines:
        first = [next(lines) for _ in range(400)]
        resume_at = lines.position
    assert resume_at.line == 401
    with open_s3_lines(s3, location, start=resume_at, chunk_bytes=4096) as lines:
        rest = list(lines)
    assert [n for n, _ in full] == list(range(1, 1001))
    assert first + rest == full
    assert json.loads(rest[0][1])["custom_id"] == "req-401"


def test_s3_resume_at_the_very_end_yields_nothing(s3: Any, bucket: str) -> None:
    data = _jsonl(3)
    s3.put_object(Bucket=bucket, Key="in.jsonl", Body=data)
    with open_s3_lines(s3, S3Location(bucket, "in.jsonl"), start=ReadPosition(4, len(data))) as lines:
        assert list(lines) == []


def test_local_resume_by_offset_and_by_line_number(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(_jsonl(50))
    with open_local_lines(path) as lines:
        full = list(lines)
        end = lines.position
    assert end == ReadPosition(51, path.stat().st_size)
    with open_local_lines(path) as lines:
        by_number = list(skip_to_line(lines, 31))
    assert by_number == full[30:]
    offset = len(_jsonl(30))
    with open_local_lines(path, start=ReadPosition(31, offset)) as lines:
        assert list(lines) == full[30:]


def _upload_large_object(s3: Any, bucket: str, key: str, parts: int) -> tuple[int, int]:
    """~`parts` x 5 MiB of distinct JSONL lines through a multipart upload; returns (lines, bytes)."""
    upload = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    filler, per_part, done, size = "x" * 4000, 5 * MiB // 4000 + 1, [], 0
    for part in range(parts):
        body = "".join(f'{{"custom_id":"r{part}-{i:05d}","body":{{"prompt":"{filler}"}}}}\n'
                       for i in range(per_part)).encode()
        etag = s3.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=part + 1, Body=body)["ETag"]
        done.append({"PartNumber": part + 1, "ETag": etag})
        size += len(body)
    s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": done})
    return parts * per_part, size


def test_50mb_input_is_streamed_with_bounded_memory(s3: Any, bucket: str) -> None:
    line_count, size = _upload_large_object(s3, bucket, "big.jsonl", parts=10)
    assert size > 50 * 1000 * 1000
    assert s3.head_object(Bucket=bucket, Key="big.jsonl")["ContentLength"] == size
    tracemalloc.start()
    try:
        count, last = 0, None
        with open_s3_lines(s3, S3Location(bucket, "big.jsonl")) as lines:
            for number, raw in lines:
                assert isinstance(raw, bytes)
                last = json.loads(raw)["custom_id"]
                count = number
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == line_count
    assert last == f"r9-{line_count // 10 - 1:05d}"
    assert peak < 10 * MiB, f"peak traced memory {peak / MiB:.1f} MiB for a {size / MiB:.0f} MiB object"


class _DroppingClient:
    """Wraps an S3 client; the first GET's body breaks after `good_chunks` chunks, like a dropped connection,
    optionally after `on_drop` ran (e.g. replacing the object)."""

    def __init__(self, s3: Any, good_chunks: int, on_drop: Any = None) -> None:
        self._s3, self._good, self._on_drop = s3, good_chunks, on_drop
        self.requests: list[dict[str, Any]] = []

    def get_object(self, **request: Any) -> dict[str, Any]:
        self.requests.append(request)
        response = self._s3.get_object(**request)
        if len(self.requests) == 1:
            response["Body"] = _BreakingBody(response["Body"], self._good, self._on_drop)
        return response


class _BreakingBody:
    def __init__(self, body: Any, good_chunks: int, on_drop: Any) -> None:
        self._body, self._good, self._on_drop = body, good_chunks, on_drop

    def iter_chunks(self, size: int) -> Any:
        for index, chunk in enumerate(self._body.iter_chunks(size)):
            if index == self._good:
                if self._on_drop is not None:
                    self._on_drop()
                raise ResponseStreamingError(error="connection reset by peer")
            yield chunk

    def close(self) -> None:
        self._body.close()


def test_s3_stream_reopens_where_a_dropped_connection_broke(s3: Any, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="in.jsonl", Body=_jsonl(300))
    location = S3Location(bucket, "in.jsonl")
    with open_s3_lines(s3, location, chunk_bytes=1000) as lines:
        full = list(lines)
    client = _DroppingClient(s3, good_chunks=5)
    with open_s3_lines(client, location, chunk_bytes=1000) as lines:
        assert list(lines) == full
    assert len(client.requests) == 2
    assert client.requests[1]["Range"] == "bytes=5000-" and client.requests[1]["IfMatch"]


def test_s3_stream_refuses_to_mix_a_replaced_object(s3: Any, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="in.jsonl", Body=_jsonl(300))
    client = _DroppingClient(s3, good_chunks=2,
                             on_drop=lambda: s3.put_object(Bucket=bucket, Key="in.jsonl", Body=_jsonl(301)))
    with pytest.raises(ClientError, match=r"PreconditionFailed|412"), \
            open_s3_lines(client, S3Location(bucket, "in.jsonl"), chunk_bytes=1000) as lines:
        list(lines)
