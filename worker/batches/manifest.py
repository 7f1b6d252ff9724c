"""The batch manifest: counts, token totals and timings, written as JSON next to the outputs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass
class BatchManifest:
    batch_id: str
    input_url: str
    output_url: str
    status: str = "in_progress"  # completed, failed, cancelled when finished
    total: int = 0  # input lines, valid or not (blank lines excluded)
    completed: int = 0
    failed: int = 0  # invalid lines and requests that failed
    cancelled: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    created_at: float | None = None  # unix seconds
    started_at: float | None = None
    finished_at: float | None = None

    def record_completed(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.completed += 1
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens

    def record_failed(self) -> None:
        self.failed += 1

    def record_cancelled(self) -> None:
        self.cancelled += 1

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def queue_s(self) -> float | None:
        return _between(self.created_at, self.started_at)

    @property
    def run_s(self) -> float | None:
        return _between(self.started_at, self.finished_at)

    @property
    def total_s(self) -> float | None:
        return _between(self.created_at, self.finished_at)

    def to_dict(self) -> dict[str, Any]:
        counts = {"total": self.total, "completed": self.completed, "failed": self.failed,
                  "cancelled": self.cancelled}
        tokens = {"prompt": self.prompt_tokens, "completion": self.completion_tokens,
                  "total": self.total_tokens}
        timings = {"created_at": self.created_at, "started_at": self.started_at,
                   "finished_at": self.finished_at, "queue_s": self.queue_s, "run_s": self.run_s,
                   "total_s": self.total_s}
        return {"batch_id": self.batch_id, "input_url": self.input_url, "output_url": self.output_url,
                "status": self.status, "request_counts": counts, "tokens": tokens, "timings": timings}

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), indent=2).encode() + b"\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BatchManifest:
        counts, tokens, timings = data["request_counts"], data["tokens"], data["timings"]
        return cls(batch_id=data["batch_id"], input_url=data["input_url"], output_url=data["output_url"],
                   status=data["status"], **counts, prompt_tokens=tokens["prompt"],
                   completion_tokens=tokens["completion"], created_at=timings["created_at"],
                   started_at=timings["started_at"], finished_at=timings["finished_at"])


def _between(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else round(end - start, 3)
