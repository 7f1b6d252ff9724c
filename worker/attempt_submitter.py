"""The attempt submitter: hands a claimed attempt's requests to the engine and routes what comes back.

An attempt in flight (worker/in_flight.py) becomes its engine requests (worker/engine_requests.py: a request
per choice of each prompt of a generation job, gathered as worker/choices.py does, or per input of an
embedding job, with the same gathering), submitted to the EngineHost once its LoRA adapter is loaded. What
the engine refuses at submit is written as the attempt's failure at once. On the engine thread then: each
update's text goes to the streamer and its first token to the outcome writer; the attempt's end goes to the
outcome writer too, except after an engine step that ran out of device memory: the attempt is submitted once
more, within the same attempt, before its failure is written (worker/transient.py says which errors qualify).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial

from conveyor.core.lanes import queue_of
from conveyor.core.protocol.job_kinds import EMBEDDING
from conveyor.core.protocol.job_params import JobParams
from conveyor.core.retry_policy import MODEL_UNAVAILABLE
from conveyor.core.store.jobs.claims import ClaimedJob
from conveyor.core.store.tables import Job
from conveyor.engine.host import EngineHost
from conveyor.engine.outputs import RequestOutput
from conveyor.worker.adapters import RuntimeAdapters
from conveyor.worker.attempt import ENGINE_ERROR, INVALID_REQUEST, Attempt, EngineFuture
from conveyor.worker.attempt_outcome import describe, to_datetime
from conveyor.worker.chat_prompt import chat_prompt_ids
from conveyor.worker.choices import gather_choices
from conveyor.worker.engine_requests import (
    EngineRequests,
    embedding_requests,
    generation_requests,
    pooling_params,
)
from conveyor.worker.in_flight import InFlight
from conveyor.worker.outcome_writer import OutcomeWriter
from conveyor.worker.sampling import sampling_params
from conveyor.worker.streamer import JobStreamer
from conveyor.worker.transient import is_transient

log = logging.getLogger(__name__)


class AttemptSubmitter:
    def __init__(self, host: EngineHost, in_flight: InFlight, writer: OutcomeWriter, *,
                 streamer: JobStreamer | None, adapters: RuntimeAdapters | None,
                 stopping: Callable[[], bool]) -> None:
        """`streamer`: text deltas to the API (None: nobody listens); `adapters`: LoRA adapters loaded at
        run time, read when a job first names one; `stopping`: whether shutdown began (no retry then)."""
        self._host = host
        self._in_flight = in_flight
        self._writer = writer
        self._streamer = streamer
        self._adapters = adapters
        self._stopping = stopping

    def submit(self, job: Job | ClaimedJob, attempt: Attempt) -> None:
        """Submits the attempt (in flight already) made of `job`; a refusal is written as its failure."""
        try:
            if attempt.lora is not None and self._adapters is not None:
                self._adapters.ensure(attempt.lora)
        except ValueError as exc:  # no such adapter for this model: the request's own error
            self._writer.refused(attempt, INVALID_REQUEST, str(exc))
            return
        except Exception as exc:  # its files unreadable for now: the retry policy's (core/retry_policy.py)
            log.warning("job %s: adapter %s not loadable: %s", job.id, attempt.lora, describe(exc))
            self._writer.refused(attempt, MODEL_UNAVAILABLE, f"adapter {attempt.lora}: {describe(exc)}")
            return
        try:
            attempt.engine_input = self._engine_input(job, attempt)
            future = self._to_engine(attempt)
        except ValueError as exc:
            self._writer.refused(attempt, INVALID_REQUEST, str(exc))
            return
        except Exception as exc:
            log.exception("engine refused job %s", job.id)
            self._writer.refused(attempt, ENGINE_ERROR, describe(exc))
            return
        future.add_done_callback(lambda f: self._ended(attempt, f))

    def _to_engine(self, attempt: Attempt) -> EngineFuture:
        if attempt.n == 1:
            return self._to_engine_choice(attempt, 0)
        # NOTE: this group's ids, taken now: when one request fails, the group's failure may resubmit the
        # attempt (a retry, under new ids) before the group cancels its other requests.
        request_ids = attempt.request_ids()
        return gather_choices(attempt.n, partial(self._to_engine_choice, attempt),
                              cancel_all=lambda: self._cancel_requests(request_ids))

    def _to_engine_choice(self, attempt: Attempt, index: int) -> Future[RequestOutput]:
        """The attempt's request `index`: a choice of its prompt, or one of its inputs."""
        requests = attempt.engine_input
        assert requests is not None and len(requests) == attempt.n
        request_class = queue_of(attempt.queue)  # the engine's class of the lane's queue
        on_update = None if attempt.embeds else lambda out: self._on_update(attempt, index, out)  # no text
        return self._host.submit(
            attempt.request_ids()[index], requests.prompts[index], requests.params[index], request_class,
            on_update=on_update, cache_salt=attempt.cache_salt, urgency=attempt.urgency, lora=attempt.lora,
            on_admitted=lambda: self._in_flight.admitted(attempt),
        )

    def _cancel_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._host.cancel(request_id)

    def _engine_input(self, job: Job | ClaimedJob, attempt: Attempt) -> EngineRequests:
        """The engine requests of the job: the n choices of each of its prompts (its `inputs`, or its one
        prompt or messages), or an embedding job's inputs, by the params the attempt read. ValueError naming
        the field for what the engine refuses."""
        if job.kind == EMBEDDING:
            if not job.inputs:
                raise ValueError("input: the embedding job has no inputs")
            return embedding_requests(job.inputs, pooling_params(_read_params(attempt)))
        params, n = sampling_params(_read_params(attempt)), attempt.choices_per_prompt()
        if job.messages is not None:
            prompt_ids = chat_prompt_ids(self._host.tokenizer, job.messages, job.chat)
            return generation_requests([prompt_ids], params, n)
        if job.inputs:
            return generation_requests(list(job.inputs), params, n)
        if job.prompt is None:
            raise ValueError("prompt: the job has neither a prompt nor messages")
        return generation_requests([job.prompt], params, n)

    # --- engine thread -----------------------------------------------------------------------------------

    def _on_update(self, attempt: Attempt, index: int, out: RequestOutput) -> None:
        if self._streamer is not None:
            self._streamer.update(attempt.job_id, attempt.attempt, out, index)
        if attempt.first_token_seen or out.metrics.first_token_time is None:
            return
        attempt.first_token_seen = True
        at = to_datetime(out.metrics.first_token_time)
        assert at is not None
        self._writer.first_token(attempt, at)

    def _ended(self, attempt: Attempt, future: EngineFuture) -> None:
        if not self._retried_once(attempt, future):
            self._writer.ended(attempt, future)

    def _retried_once(self, attempt: Attempt, future: EngineFuture) -> bool:
        """Submits the attempt again, once, after a transient engine error (worker/transient.py), under a new
        request id (the failed one's abort output is still being delivered in this step); the store sees
        one attempt. False when it is not retried: the failure is then written as usual."""
        error = future.exception()
        if (error is None or attempt.retried or attempt.engine_input is None
                or attempt.abort_reason is not None or self._stopping() or not is_transient(error)):
            return False
        attempt.retried = True
        log.warning("job %s attempt %d: %s; retrying it once on this worker", attempt.job_id, attempt.attempt,
                    describe(error))
        self._in_flight.rekey(attempt, f"{attempt.request_id}~retry")
        try:
            retry = self._to_engine(attempt)
        except Exception:
            log.exception("job %s: the retry was refused", attempt.job_id)
            return False
        retry.add_done_callback(lambda f: self._ended(attempt, f))
        return True


def _read_params(attempt: Attempt) -> JobParams:
    """The params the attempt read of its job; ValueError naming the field when they could not be read."""
    if attempt.params_error is not None:
        raise ValueError(attempt.params_error)
    return attempt.params
