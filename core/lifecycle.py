"""The statuses a job, a batch and a batch line go through, and which changes are allowed.

Job: `queued -> running -> succeeded | failed | cancelled`, `queued -> cancelled | expired`, and
`running -> queued` only when its worker died (attempts + 1 on the next claim). The store applies each change
as one conditional UPDATE (core/store/jobs.py), so a late or duplicate message can never complete a job twice
or revive a cancelled one.

Batch (OpenAI's statuses): `validating -> in_progress -> finalizing -> completed | failed | expired`, and
`validating | in_progress -> cancelling -> cancelled`; a batch whose rounds keep failing is given up on and
ends `failed` from any open status, `cancelling` included (core/store/batches.give_up). A line is `queued`
while its job is queued or running, then takes its job's outcome.
"""

from __future__ import annotations

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED, EXPIRED = (
    "queued", "running", "succeeded", "failed", "cancelled", "expired"
)
JOB_STATUSES = (QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED, EXPIRED)
TERMINAL_STATUSES = (SUCCEEDED, FAILED, CANCELLED, EXPIRED)
JOB_TRANSITIONS: dict[str, tuple[str, ...]] = {
    QUEUED: (RUNNING, CANCELLED, EXPIRED),
    RUNNING: (SUCCEEDED, FAILED, CANCELLED, QUEUED),
    SUCCEEDED: (), FAILED: (), CANCELLED: (), EXPIRED: (),
}

VALIDATING, IN_PROGRESS, FINALIZING, COMPLETED = "validating", "in_progress", "finalizing", "completed"
BATCH_FAILED, BATCH_EXPIRED, CANCELLING, BATCH_CANCELLED = "failed", "expired", "cancelling", "cancelled"
BATCH_STATUSES = (VALIDATING, IN_PROGRESS, FINALIZING, COMPLETED, BATCH_FAILED, BATCH_EXPIRED, CANCELLING,
                  BATCH_CANCELLED)
OPEN_BATCH_STATUSES = (VALIDATING, IN_PROGRESS, FINALIZING, CANCELLING)  # a runner still has work to do
# Why a batch stopped early (None: it ran to the end of its input).
STOP_FAILED, STOP_EXPIRED = "failed", "expired"

LINE_QUEUED, LINE_SUCCEEDED, LINE_FAILED, LINE_CANCELLED = "queued", "succeeded", "failed", "cancelled"
LINE_OUTCOME = {SUCCEEDED: LINE_SUCCEEDED, FAILED: LINE_FAILED, EXPIRED: LINE_FAILED,
                CANCELLED: LINE_CANCELLED}

# A webhook delivery: pending while attempts remain, then delivered or failed (a resend makes it pending).
DELIVERY_PENDING, DELIVERY_DELIVERED, DELIVERY_FAILED = "pending", "delivered", "failed"
