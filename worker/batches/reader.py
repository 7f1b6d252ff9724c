"""Stream JSONL lines from S3 or a local file without holding the input in memory.

Lines are yielded as (line_number, raw_bytes) with 1-based numbers counted over the whole file, so they
match what an editor shows; blank lines are counted but not yielded. A line longer than the limit is
yielded as an `OversizeLine` (its bytes are dropped while skipping to the next newline). After each yield,
`LineStream.position` is where the next line starts, so a later reader can resume there with one ranged
GET instead of re-reading the prefix. Only one chunk and one unfinished line are held at a time.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError

from conveyor.core.s3 import S3Location

DEFAULT_MAX_LINE_BYTES = 4 * 1024 * 1024
DEFAULT_CHUNK_BYTES = 1024 * 1024


@dataclass(frozen=True)
class ReadPosition:
    """Where reading resumes: the number the next line gets and its byte offset in the file."""

    line: int = 1
    offset: int = 0


@dataclass(frozen=True)
class OversizeLine:
    """Stands in for a line longer than `limit` bytes."""

    limit: int


RawLine = bytes | OversizeLine


class LineStream:
    """An iterator of (line_number, raw line) over a stream of byte chunks; `position` follows it."""

    def __init__(self, chunks: Iterable[bytes], start: ReadPosition, max_line_bytes: int,
                 close: Callable[[], None] | None = None) -> None:
        if max_line_bytes < 1:
            raise ValueError(f"max_line_bytes must be >= 1, got {max_line_bytes}")
        self.position = start
        self._lines = self._split(chunks, max_line_bytes)
        self._close = close

    def __iter__(self) -> Iterator[tuple[int, RawLine]]:
        return self

    def __next__(self) -> tuple[int, RawLine]:
        return next(self._lines)

    def close(self) -> None:
        self._lines.close()
        if self._close is not None:
            self._close()

    def __enter__(self) -> LineStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _split(self, chunks: Iterable[bytes], limit: int) -> Iterator[tuple[int, RawLine]]:
        number, offset = self.position.line, self.position.offset
        pending = bytearray()  # the unfinished line; never more than `limit` bytes
        oversize = False  # the unfinished line already passed `limit`: drop its bytes until the newline
        for chunk in chunks:
            start = 0
            while (newline := chunk.find(b"\n", start)) != -1:
                piece = chunk[start:newline]
                line_bytes = len(pending) + len(piece)  # pending is empty once a line went oversize
                oversize = oversize or line_bytes > limit
                raw: RawLine = OversizeLine(limit) if oversize else bytes(pending + piece)
                offset += line_bytes + 1
                pending.clear()
                yield from self._emit(number, raw, ReadPosition(number + 1, offset))
                number, oversize, start = number + 1, False, newline + 1
            tail = chunk[start:]
            if oversize or len(pending) + len(tail) > limit:
                offset += len(pending) + len(tail)
                pending.clear()
                oversize = True
            else:
                pending += tail
        if pending or oversize:  # a last line without a newline
            offset += len(pending)
            raw = OversizeLine(limit) if oversize else bytes(pending)
            yield from self._emit(number, raw, ReadPosition(number + 1, offset))

    def _emit(self, number: int, raw: RawLine, after: ReadPosition) -> Iterator[tuple[int, RawLine]]:
        self.position = after
        if isinstance(raw, bytes):
            raw = raw.removesuffix(b"\r")
            if number == 1:  # files saved by some Windows tools start with a UTF-8 byte order mark
                raw = raw.removeprefix(codecs.BOM_UTF8)
            if not raw.strip():
                return
        yield number, raw


def open_s3_lines(client: Any, location: S3Location, *, start: ReadPosition | None = None,
                  max_line_bytes: int = DEFAULT_MAX_LINE_BYTES, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                  max_reopens: int = 5) -> LineStream:
    """Lines of an S3 object, read with a streaming (ranged, when resuming) GET."""
    start = start or ReadPosition()
    chunks = _s3_chunks(client, location, start.offset, chunk_bytes, max_reopens)
    return LineStream(chunks, start, max_line_bytes, close=chunks.close)


def _s3_chunks(client: Any, location: S3Location, offset: int, chunk_bytes: int,
               max_reopens: int) -> Generator[bytes, None, None]:
    """The object's bytes from `offset`. A batch may read slowly for hours, so a dropped connection is
    reopened where it broke, pinned to the first response's ETag: a replaced object fails, never mixes."""
    etag: str | None = None
    failures = 0
    while True:
        request: dict[str, Any] = {"Bucket": location.bucket, "Key": location.key}
        if offset > 0:
            request["Range"] = f"bytes={offset}-"
        if etag is not None:
            request["IfMatch"] = etag
        try:
            response = client.get_object(**request)
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") == "InvalidRange":  # resuming exactly at the end
                return
            raise
        etag, body = response["ETag"], response["Body"]
        try:
            for chunk in body.iter_chunks(chunk_bytes):
                offset += len(chunk)
                failures = 0
                yield chunk
            return
        except (HTTPClientError, IncompleteReadError):
            failures += 1
            if failures > max_reopens:
                raise
        finally:
            body.close()


def open_local_lines(path: Path, *, start: ReadPosition | None = None,
                     max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
                     chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> LineStream:
    """Lines of a local file (uploaded files live in a local folder when embedded)."""
    start = start or ReadPosition()
    handle = Path(path).open("rb")  # noqa: SIM115 (closed by the LineStream)
    handle.seek(start.offset)
    chunks = iter(lambda: handle.read(chunk_bytes), b"")
    return LineStream(chunks, start, max_line_bytes, close=handle.close)


def skip_to_line(lines: LineStream, first_line: int) -> Iterator[tuple[int, RawLine]]:
    """Resume by line number alone (when the byte offset is unknown): drop lines numbered below it."""
    return ((number, raw) for number, raw in lines if number >= first_line)
