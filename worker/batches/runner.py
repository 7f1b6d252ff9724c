"""The batch runner: a thread in every worker process (and in the embedded runtime) that drives batches.

Each round it takes or renews the lease of a few open batches (a lease lasts worker_dead_after_s, so a dead
worker's batches pass to another runner) and, per batch, does one step:
- in_progress, input not finished: read and parse up to CHUNK_LINES lines from the saved read position, and
  commit them as one chunk (lines, a queued job per valid line, the new position), keeping at most
  batch_window_jobs of the batch's jobs queued or running; then publish the new jobs (the reconciler
  re-publishes any whose publish failed). A chunk is read once the window has room for half of it
  (worker/batches/pacing.py: a chunk's fixed costs are shared by many lines), the wait until then timed by
  the pace the batch's lines end at;
- input finished and no line queued or running: finalizing;
- finalizing or cancelling: write the outputs and close the batch (worker/batches/finalize.py).
A runner that resumes a batch reopens the input at the committed position (one ranged GET on S3) and rebuilds
the custom_id set from the committed lines, so no finished line is redone or duplicated.

A round that raises (S3 refusing the outputs, missing credentials, the store failing) backs its batch off:
the failures in a row and the time of the next attempt go into the batch row (BatchBackoff: 1 s doubling to
60 s), so every runner in every process waits it out, across restarts too, and the other batches carry on.
A round that goes through resets the count. After `max_failures` in a row (8, about two minutes) the batch
is given up on from whatever open status it is in, `cancelling` included: it ends `failed` with an error
naming the cause, and with the outputs of the lines that finished when those can still be written (not when
writing them is what failed).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.background import BackgroundLoop
from conveyor.core.clock import utcnow
from conveyor.core.lanes import lane_of
from conveyor.core.lifecycle import (
    CANCELLING,
    FINALIZING,
    IN_PROGRESS,
    STOP_EXPIRED,
    STOP_FAILED,
)
from conveyor.core.protocol.job_params import DEFAULT_MAX_TOKENS
from conveyor.core.protocol.service_tiers import takes_default_deadline
from conveyor.core.s3 import make_s3_client
from conveyor.core.seams.dispatch import Publish, publish_and_mark
from conveyor.core.settings import Settings
from conveyor.core.store import batches, finish_times, jobs, lora_adapters, tenants
from conveyor.core.store.tables import Batch
from conveyor.core.store.tenants import TenantLimits
from conveyor.worker.batches.finalize import BatchFinalizer, OutputWriteError, describe_error
from conveyor.worker.batches.lines import (
    BatchRequest,
    CustomIdSet,
    LimitsOfModel,
    LineError,
    parse_line,
)
from conveyor.worker.batches.model_limits import ModelLimits
from conveyor.worker.batches.pacing import RefillPace
from conveyor.worker.batches.prompt_length import ChatTokenizer
from conveyor.worker.batches.reader import LineStream, ReadPosition
from conveyor.worker.batches.source import open_input

log = logging.getLogger(__name__)

CHUNK_LINES = 500  # lines committed per transaction at most
MAX_BATCHES = 8  # batches one runner drives at once
STOP_WAIT_S = 10.0  # how long stop() waits for a round in progress
IDLE_S = 0.25  # the pause after a round that moved nothing (but see PACED_WAIT_INTERVALS)
# A round whose batches all wait for room at a known pace pauses until the first of them should have it, at
# most this many intervals: a new batch, a cancel or an expiry is then seen that much later (1 s by default).
PACED_WAIT_INTERVALS = 4


@dataclass(frozen=True)
class BatchBackoff:
    """How a batch whose rounds keep failing waits, and when it is given up on."""

    first_delay_s: float = 1.0  # after the first failure; doubled after each further one
    max_delay_s: float = 60.0
    max_failures: int = 8  # in a row; the batch ends failed at this one (after ~2 min with the defaults)

    def delay(self, failures: int) -> timedelta:
        """The wait after `failures` failed rounds in a row (failures >= 1)."""
        doublings = min(failures - 1, 32)  # past the cap long before; bounded so the float never overflows
        return timedelta(seconds=min(self.first_delay_s * 2**doublings, self.max_delay_s))


@dataclass
class _OpenInput:
    """A batch's input left open between rounds while this runner holds its lease."""

    stream: LineStream
    seen: CustomIdSet
    next_line: int  # the stream's position as committed; a mismatch means another runner moved it


@dataclass
class _ChunkContext:
    limits: LimitsOfModel
    paces: dict[str, finish_times.Pace | None]  # by lane: the default model's read with the limits


class BatchRunner:
    def __init__(self, sessions: sessionmaker[Session], settings: Settings, publish: Publish, owner: str, *,
                 tokenizer: ChatTokenizer | None, s3: Any, chunk_lines: int = CHUNK_LINES,
                 interval_s: float | None = None, backoff: BatchBackoff | None = None) -> None:
        """`tokenizer`: the worker's own model's (settings.served_model_id()); the other served models' are
        loaded from their folders when a line first names them. None: no line's prompt is counted."""
        self.owner = owner
        self._sessions, self._settings, self._publish = sessions, settings, publish
        self._s3, self._chunk_lines = s3, chunk_lines
        self._limits = ModelLimits(settings, tokenizer)
        self._backoff = backoff or BatchBackoff()
        self._interval_s = min(settings.reconcile_interval_s, IDLE_S) if interval_s is None else interval_s
        self._finalizer = BatchFinalizer(sessions, settings, owner, s3)
        self._refill = RefillPace(settings.batch_window_jobs, chunk_lines)
        self._pause_s = self._interval_s  # after this round, if it moved nothing
        self._waits: dict[str, float] = {}  # this round's batches waiting for room: how long
        self._inputs: dict[str, _OpenInput] = {}
        self._loop = BackgroundLoop("batch-runner", self._run_rounds)

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        if not self._loop.stop(STOP_WAIT_S):  # stuck on S3 or the store: its leases expire, others take over
            log.warning("batch runner still busy after %.0f s; leaving it behind", STOP_WAIT_S)
            return
        self._close_inputs()

    def run_once(self) -> bool:
        """One round over the batches this runner can hold; True when any of them wants its next round at once
        (it moved and can move again now), else the pause until the next one is set."""
        with self._sessions() as session:
            ids = batches.claimable(session, self.owner, utcnow(), MAX_BATCHES)
        self._waits = {}
        moved = False
        lease_s = self._settings.worker_dead_after_s
        for batch_id in ids:
            with self._sessions() as session:
                batch = batches.lease(session, batch_id, self.owner, utcnow(), lease_s)
            if batch is None:
                self._drop_input(batch_id)
                continue
            moved = self._round(batch) or moved
        self._pause_s = min((self._waits.get(batch_id, self._interval_s) for batch_id in ids),
                            default=self._interval_s)
        return moved

    def _round(self, batch: Batch) -> bool:
        batch_id = batch.id
        try:
            return self._step(batch)
        except Exception as exc:  # one batch's trouble (S3, store) must not stall the others: it backs off
            self._drop_input(batch_id)
            try:
                self._failed(batch_id, exc)
            except Exception:  # the store is down too: the next round finds out again
                log.exception("batch %s: round failed, and so did recording it", batch_id)
            return False

    def _run_rounds(self, stop: threading.Event) -> None:
        """Round after round while batches move; a pause after a round that moved none: interval_s, or less
        when a batch's window will have room for a chunk sooner."""
        while not stop.is_set():
            try:
                moved = self.run_once()
            except Exception:  # store or S3 briefly unreachable: try again next round
                log.exception("batch runner round failed")
                moved = False
            if not moved:
                stop.wait(self._pause_s)

    # --- one batch --------------------------------------------------------------------------------

    def _step(self, batch: Batch) -> bool:
        """`batch` as its lease was taken, this round."""
        if batch.status == CANCELLING:
            with self._sessions() as session:
                batches.cancel_active_jobs(session, batch.id, utcnow())  # jobs added while cancel ran
                session.commit()
        moved = self._advance(batch)
        if batch.failure_count:  # this round went through: the failures before it no longer count
            with self._sessions() as session:
                batches.clear_failures(session, batch.id)
        return moved

    def _advance(self, batch: Batch) -> bool:
        batch_id = batch.id
        if batch.status in (CANCELLING, FINALIZING):
            self._drop_input(batch_id)
            return self._finalizer.finalize(batch) is not None
        if batch.status != IN_PROGRESS:
            return False
        now = utcnow()
        if batch.expires_at is not None and now >= batch.expires_at:
            return self._stop_early(batch, STOP_EXPIRED, None)
        if not batch.read_done:
            return self._read_chunk(batch, now)
        with self._sessions() as session:
            return batches.start_finalizing(session, batch_id, self.owner, now)

    # --- failed rounds ----------------------------------------------------------------------------

    def _failed(self, batch_id: str, error: Exception) -> None:
        """Backs the batch off after a failed round, or gives it up once the failures reach the limit."""
        with self._sessions() as session:
            batch = batches.get(session, batch_id)
        if batch is None or batch.lease_owner != self.owner:
            return  # gone, or another runner holds it now and counts its own rounds
        failures = batch.failure_count + 1
        cause = describe_error(error)
        if failures >= self._backoff.max_failures:
            log.error("batch %s: round failed (%s), %d in a row; giving up", batch_id, cause, failures,
                      exc_info=error)
            self._give_up(batch, error, failures)
            return
        delay = self._backoff.delay(failures)
        log.warning("batch %s: round failed (%s), %d in a row; next attempt in %.1f s", batch_id, cause,
                    failures, delay.total_seconds(), exc_info=error)
        now = utcnow()
        with self._sessions() as session:
            batches.record_failure(session, batch_id, self.owner, now, failures=failures,
                                   retry_at=now + delay, cause=cause)

    def _give_up(self, batch: Batch, error: Exception, failures: int) -> None:
        """Ends the batch `failed`, with the outputs of what finished unless writing them is what failed."""
        errors = [*(batch.errors or []), _give_up_error(error, failures)]
        with self._sessions() as session:
            closing = batches.give_up(session, batch.id, self.owner, errors, utcnow())
        if closing is None:
            return  # the lease was lost: the new holder counts its own failures
        if not isinstance(error, OutputWriteError):
            try:
                self._finalizer.finalize(closing)
                return
            except Exception as exc:  # the outputs cannot be written either: close without them
                log.warning("batch %s: outputs not written (%s)", batch.id, describe_error(exc))
                errors.append(_give_up_error(exc, None))
        self._finalizer.close_failed(closing, errors)

    def _stop_early(self, batch: Batch, reason: str, errors: list[dict[str, Any]] | None) -> bool:
        self._drop_input(batch.id)
        with self._sessions() as session:
            return batches.stop(session, batch.id, self.owner, reason, errors, utcnow())

    def _read_chunk(self, batch: Batch, now: datetime) -> bool:
        with self._sessions() as session:
            active = batches.active_lines(session, batch.id)
            context = self._context(session, batch, now) if self._refill.ready(active) else None
        if context is None:
            self._wait_for_room(batch.id, active)
            return False
        try:
            source = self._input(batch)
            lines, new_jobs, done = self._parse_chunk(batch, source, self._refill.room(active), now, context)
        except Exception as exc:  # the input is gone, unreadable, or changed under us
            log.warning("batch %s: input %s could not be read: %s", batch.id, batch.input_url, exc)
            message = f"the input could not be read: {type(exc).__name__}"
            error = {"code": "input_unreadable", "message": message, "line": None, "param": "input"}
            return self._stop_early(batch, STOP_FAILED, [error])
        position = batches.ChunkPosition(start_line=batch.read_line, next_line=source.stream.position.line,
                                         next_offset=source.stream.position.offset, done=done)
        with self._sessions() as session:
            committed = batches.commit_chunk(session, batch.id, self.owner, position, lines, new_jobs, now)
        if not committed:
            log.warning("batch %s: chunk at line %d not committed (lease lost or batch stopped)",
                        batch.id, batch.read_line)
            self._drop_input(batch.id)
            return False
        source.next_line = position.next_line
        self._refill.read(batch.id, active, len(new_jobs), time.monotonic())
        if done:
            self._drop_input(batch.id)
        publish_and_mark(self._sessions, self._publish, [(job["id"], job["queue"]) for job in new_jobs])
        if done or self._refill.ready(active + len(new_jobs)):
            return True  # on to finalizing, or room for more already
        self._wait_for_room(batch.id, active + len(new_jobs))
        return False

    def _wait_for_room(self, batch_id: str, active: int) -> None:
        """The next round comes no later than when the batch's window should have room for a chunk."""
        self._waits[batch_id] = self._refill.wait_s(batch_id, active, time.monotonic(), self._interval_s,
                                                    PACED_WAIT_INTERVALS * self._interval_s)

    def _context(self, session: Session, batch: Batch, now: datetime) -> _ChunkContext:
        """What a chunk's lines are judged and scheduled by, read in the session of its window check: the
        tenant's priorities, the adapters loaded at run time, the pace of the batch's own lane."""
        defaults = TenantLimits.defaults(self._settings)
        priorities = tenants.effective_limits(session, batch.tenant_id, defaults).priorities
        runtime = {row.name: (row.model_id, row.tenants) for row in lora_adapters.all_adapters(session)}
        lane = lane_of(self._settings.model_id_of(None), batch.queue)  # where most lines go
        pace = finish_times.queue_pace(session, lane, now, self._settings.worker_dead_after_s)
        return _ChunkContext(self._limits.of_chunk(batch, priorities, runtime), {lane: pace})

    def _parse_chunk(self, batch: Batch, source: _OpenInput, room: int, now: datetime, context: _ChunkContext,
                     ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], bool]:
        """Up to `room` valid lines (and the invalid ones among them), at most chunk_lines in all."""
        limits, paces = context.limits, context.paces
        lines: list[dict[str, Any]] = []  # batches.queued_line / failed_line rows
        new_jobs: list[dict[str, Any]] = []  # jobs.build_row rows
        while len(new_jobs) < room and len(lines) < self._chunk_lines:
            try:
                number, raw = next(source.stream)
            except StopIteration:
                return lines, new_jobs, True
            parsed = parse_line(number, raw, source.seen, limits)
            if isinstance(parsed, BatchRequest):
                assert parsed.lane is not None, "the runner's limits name each line's lane"
                if parsed.lane not in paces:
                    paces[parsed.lane] = self._pace(parsed.lane, now)
                job = _new_job(batch, parsed, now, paces[parsed.lane])
                new_jobs.append(job)
                lines.append(batches.queued_line(batch.id, number, parsed.custom_id, job["id"]))
            else:
                lines.append(_failed_line(batch.id, parsed, source.seen))
        return lines, new_jobs, False

    def _pace(self, lane: str, now: datetime) -> finish_times.Pace | None:
        with self._sessions() as session:
            return finish_times.queue_pace(session, lane, now, self._settings.worker_dead_after_s)

    # --- open inputs ------------------------------------------------------------------------------

    def _input(self, batch: Batch) -> _OpenInput:
        current = self._inputs.get(batch.id)
        if current is not None and current.next_line == batch.read_line:
            return current
        self._drop_input(batch.id)
        with self._sessions() as session:
            seen = CustomIdSet(batches.seen_custom_ids(session, batch.id))
        stream = open_input(batch.input_url, ReadPosition(batch.read_line, batch.read_offset), s3=self._s3,
                            max_line_bytes=self._settings.batch_max_line_bytes)
        opened = _OpenInput(stream, seen, batch.read_line)
        self._inputs[batch.id] = opened
        return opened

    def _drop_input(self, batch_id: str) -> None:
        self._refill.forget(batch_id)
        opened = self._inputs.pop(batch_id, None)
        if opened is not None:
            opened.stream.close()

    def _close_inputs(self) -> None:
        for batch_id in list(self._inputs):
            self._drop_input(batch_id)


def _new_job(batch: Batch, request: BatchRequest, now: datetime, pace: finish_times.Pace | None,
             ) -> dict[str, Any]:
    """The queued job row of one valid line, built by the store's own constructor: its batch_id column names
    the batch (fair share's stream), its metadata the line it answers (shown under /v1/jobs, as
    docs/guides/batches.md says), its prompt_tokens are the tokens the line was judged by, and its latest
    start is its deadline less its run time at the queue's pace (core/store/finish_times.py)."""
    assert not isinstance(request.prompt, list), "a completions line's token ids are its job's inputs"
    meta = {"batch_id": batch.id, "custom_id": request.custom_id, "line": request.line,
            "endpoint": request.endpoint, "model": request.model}
    if request.shown:  # what the answer shows of the prompt (echo, prompt_logprobs)
        meta["shown"] = request.shown
    if request.service_tier:  # echoed in the answer
        meta["service_tier"] = request.service_tier
    asked = {"endpoint": request.endpoint, "model": request.model, "prompt": request.prompt,
             "messages": request.messages, "params": request.params,
             **({"chat": request.chat} if request.chat else {}),
             **({"inputs": request.inputs} if request.inputs is not None else {})}
    deadline_s = _line_deadline_s(request, batch, now)
    assert request.lane is not None
    new = jobs.NewJob(tenant_id=batch.tenant_id, queue=request.lane, prompt=request.prompt,
                      messages=request.messages, params=request.params, meta=meta, webhook=None,
                      idempotency_key=None, request_hash=jobs.request_hash(asked),
                      prompt_tokens=request.prompt_tokens, ttl_s=None, timeout_s=None, batch_id=batch.id,
                      chat=request.chat, priority=request.priority, deadline_s=deadline_s,
                      start_by=_start_by(request, deadline_s, now, pace), service_tier=request.service_tier,
                      kind=request.kind, inputs=request.inputs)
    return jobs.build_row(new, now)


def _start_by(request: BatchRequest, deadline_s: float | None, now: datetime, pace: finish_times.Pace | None,
              ) -> datetime | None:
    if deadline_s is None:
        return None
    max_tokens = request.params.get("max_tokens", DEFAULT_MAX_TOKENS)  # stored params: already judged
    run_s = pace.run_s(request.prompt_tokens, max_tokens) if pace is not None else None
    return finish_times.latest_start(now, deadline_s, run_s)


def _line_deadline_s(request: BatchRequest, batch: Batch, now: datetime) -> float | None:
    """The line's own deadline, else what is left of its batch's window (flex lines take none)."""
    if request.deadline_s is not None or not takes_default_deadline(request.service_tier):  # type: ignore[arg-type]
        return request.deadline_s
    return _window_left_s(batch, now)


def _window_left_s(batch: Batch, now: datetime) -> float | None:
    """A line's default deadline: what is left of its batch's completion window (at least a second)."""
    if batch.expires_at is None:
        return None
    return max((batch.expires_at - now).total_seconds(), 1.0)


def _failed_line(batch_id: str, parsed: LineError, seen: CustomIdSet) -> dict[str, Any]:
    # The first line with a custom_id owns it (a later one is a duplicate), even when the line is invalid.
    owns_id = parsed.code != "duplicate_custom_id" and parsed.custom_id in seen
    error = {"code": parsed.code, "message": parsed.message, "custom_id": parsed.custom_id}
    return batches.failed_line(batch_id, parsed.line, parsed.custom_id if owns_id else None, error)


def _give_up_error(error: Exception, failures: int | None) -> dict[str, Any]:
    """The batch-level error of a batch given up on (`failures`: the failed rounds that led there, None for
    the last try at writing its outputs)."""
    suffix = "" if failures is None else f"; gave up after {failures} failed attempts in a row"
    if isinstance(error, OutputWriteError):
        return {"code": "output_unwritable", "message": f"{error}{suffix}", "line": None, "param": "output"}
    message = f"the batch could not make progress: {describe_error(error)}{suffix}"
    return {"code": "processing_failed", "message": message, "line": None, "param": None}


def make_batch_runner(sessions: sessionmaker[Session], settings: Settings, publish: Publish, owner: str,
                      tokenizer: ChatTokenizer | None) -> BatchRunner:
    """The runner a worker process or the embedded runtime starts next to its reconciler; the S3 client
    takes its credentials from the standard AWS chain."""
    s3 = make_s3_client(settings.s3_endpoint_url, settings.s3_region)
    return BatchRunner(sessions, settings, publish, owner, tokenizer=tokenizer, s3=s3)
