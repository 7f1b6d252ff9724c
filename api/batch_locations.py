"""The operator's allowlist of S3 locations batches may read and write (`batch_s3_allowlist`): workers use
their own credentials on behalf of whoever created the batch, so without it any tenant can name any bucket
those credentials reach. An input or output outside it is refused at POST /v1/batches with a 422 naming the
field. Uploaded files (`input_file_id`) live in the operator's own store and are not checked."""

from __future__ import annotations

from collections.abc import Sequence

from conveyor.api.errors import ApiError

_UNSAFE_SEGMENTS = (".", "..")  # S3 keeps them literally, but some gateways normalise them away


def location_allowed(url: str, allowlist: Sequence[str]) -> bool:
    """Whether s3://bucket/key is inside an entry (`bucket`, or `bucket/prefix`: the key is the prefix or
    below it, segment-wise); every location is allowed when the allowlist is empty."""
    if not allowlist:
        return True
    bucket, _, key = url.removeprefix("s3://").partition("/")
    if any(segment in _UNSAFE_SEGMENTS for segment in key.split("/")):
        return False
    for entry in allowlist:
        entry_bucket, _, prefix = entry.partition("/")
        if entry_bucket == bucket and (not prefix or key == prefix or key.startswith(prefix + "/")):
            return True
    return False


def check_batch_location(url: str | None, allowlist: Sequence[str], field: str) -> None:
    """Raises ApiError(422, field) when `url` is outside the allowlist."""
    if url is not None and not location_allowed(url, allowlist):
        message = f"{field}: {url} is outside the S3 locations this server allows for batches"
        raise ApiError(422, "s3_location_not_allowed", message, field)
