"""The queue a batch's lines run in must be one some served model has: each line runs in its own model's
queue of that name (core/lanes.py). Refused at create with a 422 naming the field, whichever route made the
batch (POST /v1/batches, POST /v1/messages/batches)."""

from __future__ import annotations

from conveyor.api.deps import Services
from conveyor.api.errors import ApiError


def check_batch_queue(services: Services, queue: str) -> None:
    known = sorted({name for model in services.models for name in model.settings.queues})
    if queue not in known:
        message = f"queue: unknown queue {queue!r}; known queues: {', '.join(known)}"
        raise ApiError(422, "unknown_queue", message, "queue")
