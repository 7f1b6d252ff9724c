"""The seam between the API and the broker. api/ never imports worker/: publishers are passed in.

Dispatch scheme: "reconciler". The API commits a job, then publishes its id and marks it dispatched. If
publishing fails (or the process dies in between) the job stays queued with dispatched_at NULL, and the
worker's reconciler re-publishes it after `dispatch_grace_s`. Duplicate messages are harmless: claim() is
a conditional UPDATE.
"""

from __future__ import annotations

from typing import Protocol


class JobPublisher(Protocol):
    def publish(self, job_id: str, queue: str) -> None:
        """Hands a job id to the broker's queue; may raise (the reconciler retries later)."""

    def ping(self) -> bool:
        """Whether the broker is reachable now."""


class Runtime(Protocol):
    """Something started and stopped with the app (the embedded worker runtime)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

