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

import boto3
from botocore.config import Config

from api.settings import Settings

CHUNK_BYTES = 1 << 20


def local_files_dir(settings: Settings) -> Path:
    return (settings.data_dir / "files").resolve()


def blob_url(settings: Settings, file_id: str) -> str:
    """The URL a new file's bytes get: `files_url` + id, or data_dir/files/id."""
    if settings.files_url is None:
        return str(local_files_dir(settings) / file_id)
    prefix = settings.files_url if settings.files_url.endswith("/") else settings.files_url + "/"
    return prefix + file_id


def s3_client(settings: Settings) -> Any:
    s3_options = {"addressing_style": "path"} if settings.s3_endpoint_url else {}
    config = Config(retries={"mode": "standard", "max_attempts": 5}, s3=s3_options)
    return boto3.session.Session().client("s3", endpoint_url=settings.s3_endpoint_url,
                                          region_name=settings.s3_region, config=config)


def split_s3_url(url: str) -> tuple[str, str]:
    """`s3://bucket/key` -> (bucket, key)."""
    assert url.startswith("s3://"), url
    bucket, _, key = url[len("s3://"):].partition("/")
    return bucket, key


def save(settings: Settings, url: str, source: IO[bytes]) -> None:
    """Copies `source` (read to its end) to the blob at `url`."""
    if url.startswith("s3://"):
        bucket, key = split_s3_url(url)
        s3_client(settings).upload_fileobj(source, bucket, key)
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
        bucket, key = split_s3_url(url)
        body = s3_client(settings).get_object(Bucket=bucket, Key=key)["Body"]
        try:
            yield from body.iter_chunks(CHUNK_BYTES)
        finally:
            body.close()
        return
    with Path(url).open("rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            yield chunk
