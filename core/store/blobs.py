"""Where file bytes live: a folder under data_dir (embedded, `files_url` unset) or an S3 prefix.

A file row keeps its blob URL: a local path, or `s3://bucket/key`. Uploads stream through (S3 multipart via
boto3's managed transfer; a local `.partial` renamed into place), downloads stream out in chunks. S3
credentials come only from the standard AWS chain.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from conveyor.core.s3 import make_s3_client, parse_s3_object_url
from conveyor.core.settings import Settings

CHUNK_BYTES = 1 << 20


def local_files_dir(settings: Settings) -> Path:
    return (settings.data_dir / "files").resolve()


def blob_url(settings: Settings, file_id: str) -> str:
    """The URL a new file's bytes get: `files_url` + id, or data_dir/files/id."""
    if settings.files_url is None:
        return str(local_files_dir(settings) / file_id)
    prefix = settings.files_url if settings.files_url.endswith("/") else settings.files_url + "/"
    return prefix + file_id


def save(settings: Settings, url: str, source: IO[bytes]) -> None:
    """Copies `source` (read to its end) to the blob at `url`."""
    if url.startswith("s3://"):
        location = parse_s3_object_url(url)
        _s3(settings).upload_fileobj(source, location.bucket, location.key)
        return
    path = Path(url)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with partial.open("wb") as out:
        shutil.copyfileobj(source, out, CHUNK_BYTES)
    os.replace(partial, path)


def read_chunks(settings: Settings, url: str) -> Iterator[bytes]:
    """The blob's bytes, a chunk at a time."""
    if url.startswith("s3://"):
        location = parse_s3_object_url(url)
        body = _s3(settings).get_object(Bucket=location.bucket, Key=location.key)["Body"]
        try:
            yield from body.iter_chunks(CHUNK_BYTES)
        finally:
            body.close()
        return
    with Path(url).open("rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            yield chunk


def delete(settings: Settings, url: str) -> None:
    """Removes the blob at `url`; one already gone is no error (a delete retried, or two purges)."""
    if url.startswith("s3://"):
        location = parse_s3_object_url(url)
        _s3(settings).delete_object(Bucket=location.bucket, Key=location.key)
        return
    Path(url).unlink(missing_ok=True)


def _s3(settings: Settings) -> Any:
    return make_s3_client(settings.s3_endpoint_url, settings.s3_region)
