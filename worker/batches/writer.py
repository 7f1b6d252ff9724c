"""Batch outputs under one prefix (an S3 prefix or a local folder): a results JSONL, an errors JSONL and a
manifest JSON. S3 objects stream into a multipart upload once the buffer reaches a part (S3's minimum is
5 MiB except for the last part); an object that never fills a part is one put_object. A writer that fails
aborts its upload, so no partial object appears."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from conveyor.core.s3 import S3Location
from conveyor.worker.batches.manifest import BatchManifest

MIN_PART_BYTES = 5 * 1024 * 1024
DEFAULT_PART_BYTES = 8 * 1024 * 1024
MAX_PARTS = 10_000

log = logging.getLogger(__name__)

RESULTS_NAME = "results.jsonl"
ERRORS_NAME = "errors.jsonl"
MANIFEST_NAME = "manifest.json"


class ObjectSink(Protocol):
    def write(self, data: bytes) -> None: ...
    def close(self) -> str: ...  # commits the object; returns its URL or path
    def abort(self) -> None: ...  # drops everything written; nothing appears


class S3ObjectSink:
    def __init__(self, client: Any, location: S3Location, *, part_bytes: int = DEFAULT_PART_BYTES,
                 content_type: str = "application/jsonl") -> None:
        if part_bytes < MIN_PART_BYTES:
            raise ValueError(f"part_bytes must be >= {MIN_PART_BYTES} (S3's minimum part), got {part_bytes}")
        self._client, self._location = client, location
        self._part_bytes, self._content_type = part_bytes, content_type
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []

    @property
    def parts_uploaded(self) -> int:
        return len(self._parts)

    def write(self, data: bytes) -> None:
        self._buffer += data
        if len(self._buffer) >= self._part_bytes:
            self._upload_part()

    def close(self) -> str:
        target = {"Bucket": self._location.bucket, "Key": self._location.key}
        if self._upload_id is None:
            self._client.put_object(**target, Body=bytes(self._buffer), ContentType=self._content_type)
        else:
            if self._buffer:
                self._upload_part()
            self._client.complete_multipart_upload(**target, UploadId=self._upload_id,
                                                   MultipartUpload={"Parts": self._parts})
            self._upload_id = None
        self._buffer.clear()
        return self._location.url

    def abort(self) -> None:
        """Best effort: an abort runs because a write failed, and that failure (a missing bucket, missing
        credentials) usually fails the abort too; it must not hide the error that led here."""
        self._buffer.clear()
        upload_id, self._upload_id = self._upload_id, None
        if upload_id is None:
            return
        try:
            self._client.abort_multipart_upload(Bucket=self._location.bucket, Key=self._location.key,
                                                UploadId=upload_id)
        except Exception as exc:  # the parts stay until the bucket's lifecycle rule removes them
            log.warning("multipart upload to %s not aborted (%s)", self._location.url, type(exc).__name__)

    def _upload_part(self) -> None:
        target = {"Bucket": self._location.bucket, "Key": self._location.key}
        if self._upload_id is None:
            upload = self._client.create_multipart_upload(**target, ContentType=self._content_type)
            self._upload_id = upload["UploadId"]
        number = len(self._parts) + 1
        if number > MAX_PARTS:
            raise ValueError(f"output needs more than {MAX_PARTS} parts; raise part_bytes")
        part = self._client.upload_part(**target, UploadId=self._upload_id, PartNumber=number,
                                        Body=bytes(self._buffer))
        self._parts.append({"PartNumber": number, "ETag": part["ETag"]})
        self._buffer.clear()


class LocalFileSink:
    """Writes `path.partial`, renamed over `path` on close, so readers never see half a file."""

    def __init__(self, path: Path) -> None:
        self._path = Path(path)
        self._partial = self._path.with_name(self._path.name + ".partial")
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = self._partial.open("wb")

    def write(self, data: bytes) -> None:
        self._handle.write(data)

    def close(self) -> str:
        self._handle.close()
        os.replace(self._partial, self._path)
        return str(self._path)

    def abort(self) -> None:
        self._handle.close()
        self._partial.unlink(missing_ok=True)


class JsonlWriter:
    """JSON objects, one per line, into a sink; commits on a clean exit, aborts on an exception."""

    def __init__(self, sink: ObjectSink) -> None:
        self._sink = sink
        self.lines = 0

    def write(self, obj: dict[str, Any]) -> None:
        self._sink.write(_json_line(obj))
        self.lines += 1

    def close(self) -> str:
        return self._sink.close()

    def abort(self) -> None:
        self._sink.abort()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


def _json_line(obj: dict[str, Any]) -> bytes:
    """One compact JSON line in UTF-8. A lone surrogate (a `custom_id` may carry one as a JSON escape) has no
    UTF-8 form: that line keeps its escapes instead, still valid JSON, so one line cannot fail the output."""
    try:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
    except UnicodeEncodeError:
        return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


class BatchOutputWriter:
    """The three outputs of one batch. `close(manifest)` commits results, errors, then the manifest (its
    presence marks a finished output); `abort()` drops whatever is not committed yet."""

    def __init__(self, results: ObjectSink, errors: ObjectSink, manifest: ObjectSink) -> None:
        self.results, self.errors = JsonlWriter(results), JsonlWriter(errors)
        self._manifest = manifest

    def write_result(self, line: dict[str, Any]) -> None:
        self.results.write(line)

    def write_error(self, line: dict[str, Any]) -> None:
        """An error line goes to both files: the results file keeps one line per input line."""
        self.results.write(line)
        self.errors.write(line)

    def close(self, manifest: BatchManifest) -> dict[str, str]:
        locations = {"results": self.results.close(), "errors": self.errors.close()}
        self._manifest.write(manifest.to_json())
        locations["manifest"] = self._manifest.close()
        return locations

    def abort(self) -> None:
        for sink in (self.results, self.errors, self._manifest):
            sink.abort()

    def __enter__(self) -> BatchOutputWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if kind is not None:
            self.abort()


def open_s3_output(client: Any, prefix: S3Location, *, part_bytes: int = DEFAULT_PART_BYTES,
                   ) -> BatchOutputWriter:
    manifest = S3ObjectSink(client, prefix.child(MANIFEST_NAME), content_type="application/json")
    return BatchOutputWriter(S3ObjectSink(client, prefix.child(RESULTS_NAME), part_bytes=part_bytes),
                             S3ObjectSink(client, prefix.child(ERRORS_NAME), part_bytes=part_bytes), manifest)


def open_local_output(folder: Path) -> BatchOutputWriter:
    folder = Path(folder)
    return BatchOutputWriter(LocalFileSink(folder / RESULTS_NAME), LocalFileSink(folder / ERRORS_NAME),
                             LocalFileSink(folder / MANIFEST_NAME))
