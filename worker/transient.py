"""Which engine failures are worth one more try on the same worker: running out of device memory on a step.

A step that ran out of memory failed because of what else was in the batch at that moment (its KV blocks
are freed with it, and the batch moves on), not because of the request itself; a second try usually fits.
When it does not, the job fails with `out_of_memory`, which the retry policy reschedules after a backoff
while the job has retries left (core/retry_policy.py). Any other failure is the request's own (a bad
grammar, a NaN) or the device's, and is final.
"""

from __future__ import annotations

import torch


def is_transient(exc: BaseException) -> bool:
    """True for torch's out-of-memory error, raised alone or as the cause of the engine's StepError."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, torch.OutOfMemoryError):
            return True
        seen.add(id(current))
        current = current.__cause__
    return False
