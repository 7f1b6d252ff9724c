"""When a new job of a queue would finish, predicted from the store: the output tokens the queue's workers
delivered over the last RATE_WINDOW (its rate at the current load), and the output still ahead of the new
job (every queued and running job of the queue may write up to n x max_tokens: an upper bound, so the
prediction errs late, and a job asking to be refused when it cannot make its deadline is refused early
rather than accepted and missed).

Prefill is not counted apart: at the rates a queue runs, its prompts are a small part of a step's work,
and a workload with long prompts shows it as a lower output rate. No rate (nothing finished in the window,
or the queue idle): no prediction.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Integer, cast, func, select
from sqlalchemy.orm import Session

from core.lifecycle import QUEUED, RUNNING, SUCCEEDED
from core.store.tables import Job
from core.store.token_usage import DEFAULT_MAX_TOKENS

RATE_WINDOW = timedelta(minutes=5)


@dataclass(frozen=True)
class QueueRate:
    tokens_per_s: float  # output tokens the queue delivered per second over the window
    tokens_ahead: int  # upper bound of the output its queued and running jobs may still write

    def finish_at(self, now: datetime, own_tokens: int) -> datetime:
        """When a job writing up to `own_tokens` would finish, behind everything ahead of it."""
        return now + timedelta(seconds=(self.tokens_ahead + own_tokens) / self.tokens_per_s)


def queue_rate(session: Session, queue: str, now: datetime) -> QueueRate | None:
    """The queue's measured rate and the work ahead, or None when nothing finished in the window."""
    delivered = session.execute(
        select(func.coalesce(func.sum(Job.completion_tokens), 0))
        .where(Job.queue == queue, Job.status == SUCCEEDED, Job.finished_at > now - RATE_WINDOW)
    ).scalar_one()
    if not delivered:
        return None
    max_tokens = func.coalesce(cast(Job.params["max_tokens"].as_integer(), Integer), DEFAULT_MAX_TOKENS)
    choices = func.coalesce(cast(Job.params["n"].as_integer(), Integer), 1)
    ahead = session.execute(
        select(func.coalesce(func.sum(max_tokens * choices), 0))
        .where(Job.queue == queue, Job.status.in_((QUEUED, RUNNING)))
    ).scalar_one()
    return QueueRate(int(delivered) / RATE_WINDOW.total_seconds(), int(ahead))
