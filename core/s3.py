"""`s3://` URLs and the boto3 client. Credentials come only from the standard AWS chain (environment,
shared config, instance or container role); nothing here stores or logs them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import boto3
from botocore.config import Config

# Lowercase letters, digits, dots and hyphens; 3-63 characters; starts and ends with a letter or digit.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class S3Location:
    bucket: str
    key: str  # an object key, or a prefix ("" or ending in "/")

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def child(self, name: str) -> S3Location:
        """The object `name` under this prefix."""
        assert self.key == "" or self.key.endswith("/"), "child() needs a prefix"
        return S3Location(self.bucket, self.key + name)


def parse_s3_object_url(url: str) -> S3Location:
    """`s3://bucket/key` → S3Location; the key must name an object (not empty, not ending in '/')."""
    location = _split(url)
    if not location.key or location.key.endswith("/"):
        raise ValueError(f"S3 object URL must name a key (s3://bucket/key), got {url!r}")
    return location


def parse_s3_prefix_url(url: str) -> S3Location:
    """`s3://bucket/prefix/` (or `s3://bucket/prefix`, or `s3://bucket`) → a prefix ending in '/' or empty."""
    location = _split(url)
    key = location.key if location.key == "" or location.key.endswith("/") else location.key + "/"
    return S3Location(location.bucket, key)


def _split(url: str) -> S3Location:
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise ValueError(f"S3 URL must start with 's3://', got {url!r}")
    bucket, _, key = url[len("s3://"):].partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise ValueError(f"S3 URL has an invalid bucket name {bucket!r} (3-63 of a-z, 0-9, '.', '-')")
    if key.startswith("/") or "//" in key:
        raise ValueError(f"S3 URL key must not contain empty path segments, got {url!r}")
    if len(key.encode()) > 1024:
        raise ValueError("S3 URL key is longer than 1024 bytes")
    return S3Location(bucket, key)


def make_s3_client(endpoint_url: str | None, region: str | None) -> Any:
    """A boto3 S3 client. `endpoint_url` points at MinIO, R2, moto...; path-style addressing is used then,
    since those servers rarely resolve bucket subdomains."""
    s3_options = {"addressing_style": "path"} if endpoint_url else {}
    config = Config(retries={"mode": "standard", "max_attempts": 5}, s3=s3_options)
    session = boto3.session.Session()
    return session.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)
