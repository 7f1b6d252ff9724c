"""Server-sent events read from a stream's lines: (event name, its JSON data) pairs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any


def job_events(lines: Iterator[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    kind = ""
    for line in lines:
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
        elif line.startswith("data: "):
            yield kind, json.loads(line.removeprefix("data: "))
