"""The jobs table: job rows and their state transitions, one module per kind of work.

Every status change is ONE conditional UPDATE (`WHERE id = :id AND status IN (...)`, plus the attempt
number where a worker reports: transitions.py), so a late or duplicate message can never complete a job twice
or revive a cancelled one. Each transition commits its own transaction and says whether it applied, except
that a worker's writes for one engine step (first tokens, outcomes) and its claims go in groups, one
transaction and one set of follow-on effects per group, each row still behind its own condition. Times are
timezone-aware UTC datetimes.

Callers use the operations by this package's name (`jobs.claim_many(...)`); the modules say where each lives:
inserts, reads, claims, outcomes, cancels, retries (with the attempts' history), recovery, scheduling,
dispatch marks and deletion.
"""

from conveyor.core.store.jobs.cancels import cancel, cancel_queued
from conveyor.core.store.jobs.claims import claim, claim_ids, claim_many
from conveyor.core.store.jobs.deletion import (
    DELETABLE_STATUSES,
    JobDeletion,
    delete_finished,
    delete_rows,
    open_batch_of,
)
from conveyor.core.store.jobs.dispatch_marks import (
    dispatched_but_queued,
    mark_dispatched,
    queued,
    undispatched,
)
from conveyor.core.store.jobs.inserts import (
    NewJob,
    add,
    build,
    build_row,
    insert_rows,
    new_job_id,
    request_hash,
)
from conveyor.core.store.jobs.outcomes import (
    Completion,
    Failure,
    FirstToken,
    Outcome,
    complete,
    fail,
    record_first_token,
    record_step,
)
from conveyor.core.store.jobs.reads import (
    AttemptState,
    DeadlineCounts,
    attempt_states,
    by_idempotency_key,
    count_queued,
    deadline_counts,
    failures_since,
    get,
    get_many,
    page,
    succeeded_per_minute,
)
from conveyor.core.store.jobs.recovery import (
    EXPIRE_BATCH,
    adopt_bare_queued,
    expire_overdue,
    fail_lost,
    output_bound,
    requeue_orphans,
    requeue_unheld,
)
from conveyor.core.store.jobs.retries import RetryResult, retry, used_retry_key
from conveyor.core.store.jobs.scheduling import (
    PROMOTE_BATCH,
    count_scheduled,
    count_scheduled_in,
    next_due,
    promote_due,
)
from conveyor.core.store.jobs.transitions import lock_in_id_order, status_is

__all__ = [
    "DELETABLE_STATUSES", "EXPIRE_BATCH", "PROMOTE_BATCH", "AttemptState", "Completion", "DeadlineCounts",
    "Failure", "FirstToken", "JobDeletion", "NewJob", "Outcome", "RetryResult", "add", "adopt_bare_queued",
    "attempt_states", "build", "build_row", "by_idempotency_key", "cancel", "cancel_queued", "claim",
    "claim_ids", "claim_many", "complete", "count_queued", "count_scheduled", "count_scheduled_in",
    "deadline_counts", "delete_finished", "delete_rows", "dispatched_but_queued", "expire_overdue", "fail",
    "fail_lost", "failures_since", "get", "get_many", "insert_rows", "lock_in_id_order", "mark_dispatched",
    "new_job_id", "next_due", "open_batch_of", "output_bound", "page", "promote_due", "queued",
    "record_first_token", "record_step", "request_hash", "requeue_orphans", "requeue_unheld", "retry",
    "status_is", "succeeded_per_minute", "undispatched", "used_retry_key",
]
