from __future__ import annotations

import pytest

from conveyor.core.s3 import S3Location, make_s3_client, parse_s3_object_url, parse_s3_prefix_url


def test_object_url() -> None:
    assert parse_s3_object_url("s3://my-bucket/in/batch.jsonl") == S3Location("my-bucket", "in/batch.jsonl")


@pytest.mark.parametrize("url", ["s3://my-bucket/out/", "s3://my-bucket/out"])
def test_prefix_url_ends_with_slash(url: str) -> None:
    prefix = parse_s3_prefix_url(url)
    assert prefix == S3Location("my-bucket", "out/")
    assert prefix.child("results.jsonl").url == "s3://my-bucket/out/results.jsonl"


def test_bucket_root_prefix() -> None:
    assert parse_s3_prefix_url("s3://my-bucket").child("x").key == "x"


@pytest.mark.parametrize(("url", "fragment"), [
    ("https://my-bucket/key", "must start with 's3://'"),
    ("s3://My_Bucket/key", "invalid bucket name"),
    ("s3://ab/key", "invalid bucket name"),
    ("s3://my-bucket", "must name a key"),
    ("s3://my-bucket/dir/", "must name a key"),
    ("s3://my-bucket/a//b", "empty path segments"),
])
def test_bad_object_urls(url: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_s3_object_url(url)


def test_client_uses_endpoint_and_path_style() -> None:
    client = make_s3_client("http://127.0.0.1:9000", "eu-west-1")
    assert client.meta.endpoint_url == "http://127.0.0.1:9000"
    assert client.meta.region_name == "eu-west-1"
    assert client.meta.config.s3["addressing_style"] == "path"
