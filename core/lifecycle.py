"""The statuses a job, a batch and a batch line go through, and which changes are allowed.

Job: `queued -> running -> succeeded | failed | cancelled`, `queued -> cancelled | expired`, and
`running -> queued` only when its worker died (attempts + 1 on the next claim). A job given `run_at` or
`delay_s` starts `scheduled` and becomes `queued` when due (worker/promoter.py), or is cancelled first. A
retryable failure with retries left goes `running -> scheduled` (its backoff, core/retry_policy.py), and
`POST /v1/jobs/{id}/retry` takes a failed, cancelled or expired job back to `queued` (or `scheduled`). The
store applies each change as one conditional UPDATE (core/store/jobs/), so a late or duplicate message can
never complete a job twice or revive a cancelled one.

Batch (OpenAI's statuses): `validating -> in_progress -> finalizing -> completed | failed | expired`, and
`validating | in_progress -> cancelling -> cancelled`; a batch whose rounds keep failing is given up on and
ends `failed` from any open status, `cancelling` included (core/store/batches.give_up). A line is `queued`
while its job is queued or running, then takes its job's outcome.
"""

from __future__ import annotations

SCHEDULED, QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED, EXPIRED = (
    "scheduled", "queued", "running", "succeeded", "failed", "cancelled", "expired"
)
JOB_STATUSES = (SCHEDULED, QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED, EXPIRED)
TERMINAL_STATUSES = (SUCCEEDED, FAILED, CANCELLED, EXPIRED)
RETRYABLE_STATUSES = (FAILED, CANCELLED, EXPIRED)  # POST /v1/jobs/{id}/retry runs these again
WAITING_STATUSES = (SCHEDULED, QUEUED)  # not started: cancelled by a purge, cancellable, not yet run
JOB_TRANSITIONS: dict[str, tuple[str, ...]] = {
    SCHEDULED: (QUEUED, CANCELLED),
    QUEUED: (RUNNING, CANCELLED, EXPIRED),
    RUNNING: (SUCCEEDED, FAILED, CANCELLED, QUEUED, SCHEDULED),
    SUCCEEDED: (), FAILED: (QUEUED, SCHEDULED), CANCELLED: (QUEUED, SCHEDULED), EXPIRED: (QUEUED, SCHEDULED),
}

VALIDATING, IN_PROGRESS, FINALIZING, COMPLETED = "validating", "in_progress", "finalizing", "completed"
BATCH_FAILED, BATCH_EXPIRED, CANCELLING, BATCH_CANCELLED = "failed", "expired", "cancelling", "cancelled"
BATCH_STATUSES = (VALIDATING, IN_PROGRESS, FINALIZING, COMPLETED, BATCH_FAILED, BATCH_EXPIRED, CANCELLING,
                  BATCH_CANCELLED)
OPEN_BATCH_STATUSES = (VALIDATING, IN_PROGRESS, FINALIZING, CANCELLING)  # a runner still has work to do
# Why a batch stopped early (None: it ran to the end of its input).
STOP_FAILED, STOP_EXPIRED = "failed", "expired"

LINE_QUEUED, LINE_SUCCEEDED, LINE_FAILED, LINE_CANCELLED = "queued", "succeeded", "failed", "cancelled"
# The error codes of the lines a batch never finished: cut short by a cancel, or by the end of its window.
LINE_CANCELLED_CODE, LINE_EXPIRED_CODE = "batch_cancelled", "batch_expired"
LINE_OUTCOME = {SUCCEEDED: LINE_SUCCEEDED, FAILED: LINE_FAILED, EXPIRED: LINE_FAILED,
                CANCELLED: LINE_CANCELLED}

# A webhook delivery: pending while attempts remain, then delivered or failed (a resend makes it pending).
DELIVERY_PENDING, DELIVERY_DELIVERED, DELIVERY_FAILED = "pending", "delivered", "failed"
