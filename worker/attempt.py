"""An attempt: one run of a job on this worker, from its claim to its outcome written and acknowledged.

Attempts, not jobs, are the unit here: each is keyed by its request id in the engine (`job#attempt`), so a
late attempt 1 can never remove, or answer for, an attempt 2 of the same job in this worker. An attempt
resubmitted once after a transient engine error (worker/transient.py) keeps its identity in the store and
takes a new request id in the engine (`job#attempt~retry`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from conveyor.core.protocol.job_kinds import EMBEDDING
from conveyor.core.protocol.job_params import JobParams
from conveyor.core.store.jobs.claims import ClaimedJob
from conveyor.core.store.jobs.sequences import sequences_of
from conveyor.core.store.tables import Job
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.sequence import Urgency
from conveyor.worker.choices import choice_request_ids
from conveyor.worker.engine_requests import EngineRequests

OnDone = Callable[[], None]  # called once per started attempt, after its outcome is stored (the caller acks)
# What the engine gives back for an attempt: its output, or each request's when it has several (a job's n > 1
# choices, an embedding job's inputs).
EngineFuture = Future[RequestOutput] | Future[list[RequestOutput]]

# Failure codes written to the store.
INVALID_REQUEST, ENGINE_ERROR, TIMEOUT = "invalid_request", "engine_error", "timeout"
# Abort reasons with nothing to write (TIMEOUT, an abort reason too, is written as a failure).
CANCELLED_REASON, SHUTDOWN, SUPERSEDED = "cancelled", "shutdown", "superseded"


@dataclass
class Attempt:
    job_id: str
    attempt: int
    queue: str
    request_id: str
    timeout_s: float | None
    started: float  # time.monotonic() at claim
    on_done: OnDone
    logprobs: int | None = None  # top-n alternatives asked for per generated token
    abort_reason: str | None = None  # "cancelled" | "timeout" | "shutdown" | "superseded" once aborted
    first_token_seen: bool = False
    engine_input: EngineRequests | None = None  # what was submitted, for a retry
    retried: bool = False  # a transient engine error (out of memory) already had its one retry
    cache_salt: str | None = None  # its tenant's prefix-cache partition (core/store/tenants.py cache_salt)
    # Waiting for its grammar to compile, outside the engine: not counted in its queue's room
    # (worker/queue_room.py), so a costly schema holds up no other job's start.
    compiling: bool = False
    n: int = 1  # its requests in the engine: the choices of every prompt, or an embedding job's inputs
    # A completion whose prompts are token ids or several (its `inputs`): how many, each with n / prompts
    # choices; None: its one text prompt, or its messages.
    prompts: int | None = None
    embeds: bool = False  # an embedding job: its outcome is a vector per input (worker/attempt_outcome.py)
    prompt_logprobs: int | None = None  # top-n alternatives asked for per prompt token
    urgency: Urgency = field(default_factory=Urgency)  # its priority and deadline, for the engine's order
    lora: str | None = None  # the LoRA adapter it runs with (core/model_adapters.py); None: the base model
    params: JobParams = field(default_factory=JobParams)  # its job's, read once (the defaults if unreadable)
    params_error: str | None = None  # why its job's params could not be read: its submit fails with it

    def request_ids(self) -> list[str]:
        """Its requests in the engine: one per choice, or per input of an embedding job."""
        return choice_request_ids(self.request_id, self.n)

    @classmethod
    def of(cls, job: Job | ClaimedJob, on_done: OnDone, cache_salt: str, started: float) -> Attempt:
        """The attempt a claim just made of `job` (its attempts counter already raised by the claim)."""
        params, params_error = _params_of(job)
        embeds = job.kind == EMBEDDING
        prompts = len(job.inputs) if job.inputs and not embeds else None
        return cls(job.id, job.attempts, job.queue, f"{job.id}#{job.attempts}", job.timeout_s, started,
                   on_done, logprobs=params.logprobs, cache_salt=cache_salt,
                   compiling=params.structured is not None, n=sequences_of(job.kind, params.n, job.inputs),
                   embeds=embeds,
                   prompt_logprobs=params.prompt_logprobs, urgency=urgency_of(job), lora=params.lora,
                   prompts=prompts, params=params, params_error=params_error)

    def choices_per_prompt(self) -> int:
        """A generation job's n: its requests are n choices of each prompt, choice c of prompt p at
        p * n + c."""
        return self.n // (self.prompts or 1)


def _params_of(job: Job | ClaimedJob) -> tuple[JobParams, str | None]:
    """The job's params, or the defaults and why for a row they cannot be read from: an attempt is made of
    every claimed job at once, and such a job's submit (worker/attempt_submitter.py) then fails it alone, as
    an invalid request naming the field."""
    try:
        return JobParams.from_stored(job.params), None
    except ValueError as exc:
        return JobParams(), str(exc)


def urgency_of(job: Job | ClaimedJob) -> Urgency:
    """The job's priority and deadline as the engine orders by them (a wall-clock deadline, time.time())."""
    deadline = job.deadline_at.timestamp() if job.deadline_at is not None else None
    return Urgency(priority=job.priority or 0, deadline=deadline)
