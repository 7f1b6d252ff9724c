"""Opening a batch's input where its reading stopped: an S3 object, or an uploaded file's blob (a local path
when embedded, an s3:// URL otherwise)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conveyor.core.s3 import parse_s3_object_url
from conveyor.worker.batches.reader import LineStream, ReadPosition, open_local_lines, open_s3_lines


def open_input(input_url: str, start: ReadPosition, *, s3: Any, max_line_bytes: int) -> LineStream:
    if input_url.startswith("s3://"):
        return open_s3_lines(s3, parse_s3_object_url(input_url), start=start, max_line_bytes=max_line_bytes)
    return open_local_lines(Path(input_url), start=start, max_line_bytes=max_line_bytes)
