"""Embedded mode's broker: one in-process FIFO of job ids per queue, drained by the embedded runtime."""

from __future__ import annotations

import queue as stdlib_queue

WAKE = ""  # put in a queue to wake its feeder without a job: room freed, or the runtime stopping


class InProcessPublisher:
    def __init__(self, queue_names: list[str]) -> None:
        self.queues: dict[str, stdlib_queue.SimpleQueue[str]] = {
            name: stdlib_queue.SimpleQueue() for name in queue_names
        }

    def publish(self, job_id: str, queue: str) -> None:
        if queue not in self.queues:
            raise ValueError(f"queue: unknown queue {queue!r}; known: {sorted(self.queues)}")
        self.queues[queue].put(job_id)

    def wake(self, queue: str) -> None:
        self.queues[queue].put(WAKE)

    def depth(self, queue: str) -> int:
        return self.queues[queue].qsize()

    def ping(self) -> bool:
        return True

    def lost_messages(self) -> bool:
        return False  # the queues live and die with this process, and its start reloads them from the store
