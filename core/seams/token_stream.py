"""The seam that carries a running job's text from the worker to the API while it generates.

The worker publishes `TokenEvent`s per job (text deltas, then one end marker after the outcome is stored);
the API subscribes to a job BEFORE dispatching it, so no delta is missed. Events are a latency aid, never
the record: the store stays the source of truth, and the API reconciles with the stored text at the end
(a lost event, or no stream at all, only delays text). api/ never imports worker/: an implementation is
passed to create_app (embedded: the runtime's in-process hub, worker/token_sinks.py; Celery mode: Redis
pub/sub, api/token_subscriptions.py and worker/token_sinks.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol

CHANNEL_PREFIX = "conveyor:job-tokens:"


@dataclass(frozen=True)
class TokenEvent:
    attempt: int  # the job's attempt: a redelivered job streams again from its first token
    text: str = ""  # new text since the previous event of this attempt
    end: bool = False  # the job left the worker (its outcome, if any, is in the store)
    tokens: int = 0  # tokens this choice has generated so far (usage in every streamed chunk)
    index: int = 0  # the choice (a job with n > 1 streams each)

    def encode(self) -> str:
        fields = {"a": self.attempt, "t": self.text, "e": self.end, "n": self.tokens, "i": self.index}
        return json.dumps(fields, separators=(",", ":"))

    @classmethod
    def decode(cls, raw: str | bytes) -> TokenEvent:
        data = json.loads(raw)  # "n" and "i" are absent from the events of a worker older than the API
        return cls(attempt=int(data["a"]), text=str(data["t"]), end=bool(data["e"]),
                   tokens=int(data.get("n", 0)), index=int(data.get("i", 0)))


def channel(job_id: str) -> str:
    """The pub/sub channel of one job."""
    return CHANNEL_PREFIX + job_id


class Subscription(Protocol):
    async def get(self, timeout_s: float) -> TokenEvent | None:
        """The next event, or None when none came within timeout_s."""

    async def close(self) -> None: ...


class TokenStream(Protocol):
    async def subscribe(self, job_id: str) -> Subscription:
        """Listens to one job; events published after this returns are delivered."""


class TokenSink(Protocol):
    def listening(self, job_id: str) -> bool:
        """Whether publishing this job's deltas may reach anyone (a cheap, possibly stale answer)."""

    def publish(self, job_id: str, event: TokenEvent) -> None:
        """Never blocks and never raises: called from the engine thread."""
