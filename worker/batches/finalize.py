"""Writing a finished (or cancelled, expired, failed) batch's outputs, then closing it in the store.

Two output kinds, chosen per batch:
- S3 batches (an `output` prefix): `results.jsonl` holds one line per input line in input order (the
  response, or the error), `errors.jsonl` the failed and cancelled lines only, `manifest.json` the counts,
  token totals and timings. Lines never read (a cancel or an expiry stopped the reading) are read now and
  written as `batch_cancelled` / `batch_expired` errors, so the results still cover every input line.
- OpenAI-style batches (no `output`; the input was an uploaded file): as OpenAI does, the output file holds
  only the successful lines and the error file the others; both become files (`output_file_id`,
  `error_file_id`, purpose `batch_output`), registered only when they have lines.
Each line is rendered as the batch's endpoint answers: OpenAI's batch lines, or for a Message Batch (endpoint
/v1/messages) Anthropic's results lines (core/views/message_batch_objects.py), whose results file is the
output file followed by the error file.
The batch's final status, its files and its `batch.*` webhook event commit in one transaction. A storage
error while writing (S3 refusing, credentials missing, a full disk) is raised as OutputWriteError naming the
location and the cause, for the runner's backoff and, in the end, the batch's error; `close_failed` closes a
batch given up on without outputs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from sqlalchemy import Row
from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.clock import utcnow
from conveyor.core.lifecycle import (
    BATCH_CANCELLED,
    BATCH_EXPIRED,
    BATCH_FAILED,
    COMPLETED,
    LINE_CANCELLED,
    LINE_CANCELLED_CODE,
    LINE_EXPIRED_CODE,
    LINE_SUCCEEDED,
    STOP_EXPIRED,
    STOP_FAILED,
)
from conveyor.core.model_adapters import job_model_id
from conveyor.core.protocol.anthropic_request import MESSAGES
from conveyor.core.protocol.chat_options import ChatOptions
from conveyor.core.protocol.embedding_request import EMBEDDINGS
from conveyor.core.protocol.job_params import JobParams
from conveyor.core.s3 import parse_s3_object_url, parse_s3_prefix_url
from conveyor.core.settings import Settings
from conveyor.core.store import batches, blobs, files, webhook_events
from conveyor.core.store.tables import Batch, File
from conveyor.core.views.anthropic_objects import message_id, message_object
from conveyor.core.views.embedding_objects import embedding_list
from conveyor.core.views.message_batch_objects import succeeded_line, unsucceeded_line
from conveyor.core.views.openai_objects import (
    GenerationResult,
    PromptView,
    batch_error_line,
    batch_result_line,
    chat_completion,
    new_id,
    text_completion,
)
from conveyor.core.views.public import batch_public
from conveyor.worker.batches.lines import CHAT
from conveyor.worker.batches.manifest import BatchManifest
from conveyor.worker.batches.reader import ReadPosition
from conveyor.worker.batches.source import open_input
from conveyor.worker.batches.writer import (
    JsonlWriter,
    LocalFileSink,
    ObjectSink,
    S3ObjectSink,
    open_s3_output,
)

log = logging.getLogger(__name__)

RENEW_EVERY_LINES = 2000  # a long write renews the lease this often
_EVENTS = {COMPLETED: "batch.completed", BATCH_FAILED: "batch.failed", BATCH_CANCELLED: "batch.cancelled",
           BATCH_EXPIRED: "batch.expired"}


_STORAGE_ERRORS = (ClientError, BotoCoreError, OSError)


class LeaseLostError(RuntimeError):
    """Another runner took the batch over while its outputs were being written."""


class OutputWriteError(RuntimeError):
    """The outputs could not be written where they go; the message names the place and the cause only (an
    S3 error's code, an exception's class), never credentials or request details."""

    def __init__(self, where: str, cause: str) -> None:
        super().__init__(f"could not write outputs to {where}: {cause}")
        self.where, self.cause = where, cause


def describe_error(error: BaseException) -> str:
    """A short, safe name for a failure: S3's error code (NoSuchBucket, AccessDenied, ...) or the class."""
    if isinstance(error, OutputWriteError):
        return str(error)
    if isinstance(error, ClientError):
        return str(error.response.get("Error", {}).get("Code") or type(error).__name__)
    return type(error).__name__


@dataclass
class _Outcome:
    """Counts of the lines written so far."""

    manifest: BatchManifest
    unread: int = 0
    kinds: dict[str, int] = field(default_factory=dict)


class _CountingSink:
    """An ObjectSink that remembers how many bytes went through (a file's size)."""

    def __init__(self, sink: ObjectSink) -> None:
        self.sink, self.bytes = sink, 0

    def write(self, data: bytes) -> None:
        self.sink.write(data)
        self.bytes += len(data)

    def close(self) -> str:
        return self.sink.close()

    def abort(self) -> None:
        self.sink.abort()


class BatchFinalizer:
    def __init__(self, sessions: sessionmaker[Session], settings: Settings, owner: str, s3: Any,
) -> None:
        self._sessions, self._settings, self._owner = sessions, settings, owner
        self._s3 = s3

    def finalize(self, batch: Batch) -> str | None:
        """Writes the outputs and closes the batch; returns its final status (None if the lease was lost)."""
        status = batches.final_status(batch)
        manifest = BatchManifest(batch.id, batch.input_url, batch.output_url or "files", status=status,
                                 created_at=_ts(batch.created_at), started_at=_ts(batch.in_progress_at))
        outcome = _Outcome(manifest)
        outputs: dict[str, str] = {}
        new_files: list[File | None] = []
        try:
            if batch.output_url is not None:
                outputs = self._write_s3(batch, outcome)
            else:
                new_files = self._write_files(batch, outcome)
        except LeaseLostError:
            log.warning("batch %s: lease lost while writing outputs; the new holder writes them", batch.id)
            return None
        except _STORAGE_ERRORS as exc:
            where = batch.output_url or "the file store"
            raise OutputWriteError(where, describe_error(exc)) from exc
        return self._close(batch, status, outcome, outputs, new_files)

    def close_failed(self, batch: Batch, errors: list[dict[str, Any]]) -> str | None:
        """Closes a batch given up on as `failed` with `errors` and no outputs (they could not be written)."""
        manifest = BatchManifest(batch.id, batch.input_url, batch.output_url or "files", status=BATCH_FAILED)
        return self._close(batch, BATCH_FAILED, _Outcome(manifest), {}, [], errors=errors)

    # --- output kinds -----------------------------------------------------------------------------

    def _write_s3(self, batch: Batch, outcome: _Outcome) -> dict[str, str]:
        assert batch.output_url is not None
        prefix = parse_s3_prefix_url(batch.output_url)
        with open_s3_output(self._s3, prefix, part_bytes=self._settings.batch_part_bytes) as writer:
            for ok, line in self._lines(batch, outcome):
                (writer.write_result if ok else writer.write_error)(line)
            outcome.manifest.finished_at = utcnow().timestamp()
            return writer.close(outcome.manifest)

    def _write_files(self, batch: Batch, outcome: _Outcome) -> list[File | None]:
        """[output file, error file], each None when it would be empty."""
        output_id, error_id = files.new_file_id(), files.new_file_id()
        output_sink, error_sink = self._file_sink(output_id), self._file_sink(error_id)
        output, errors = JsonlWriter(output_sink), JsonlWriter(error_sink)
        try:
            for ok, line in self._lines(batch, outcome):
                (output if ok else errors).write(line)
        except BaseException:
            output.abort()
            errors.abort()
            raise
        return [self._commit_file(batch, output_id, output, output_sink, "output"),
                self._commit_file(batch, error_id, errors, error_sink, "errors")]

    def _file_sink(self, file_id: str) -> _CountingSink:
        url = blobs.blob_url(self._settings, file_id)
        if url.startswith("s3://"):
            location = parse_s3_object_url(url)
            return _CountingSink(S3ObjectSink(self._s3, location, part_bytes=self._settings.batch_part_bytes))
        return _CountingSink(LocalFileSink(Path(url)))

    def _commit_file(self, batch: Batch, file_id: str, writer: JsonlWriter, sink: _CountingSink,
                     name: str) -> File | None:
        if not writer.lines:
            writer.abort()
            return None
        url = writer.close()
        return File(id=file_id, tenant_id=batch.tenant_id, purpose=files.BATCH_OUTPUT,
                          filename=f"{batch.id}_{name}.jsonl", bytes=sink.bytes, url=url, created_at=utcnow())

    # --- lines ------------------------------------------------------------------------------------

    def _lines(self, batch: Batch, outcome: _Outcome) -> Iterator[tuple[bool, dict[str, Any]]]:
        """(succeeded?, output line) for every input line, in input order."""
        written = 0
        with self._sessions() as session:
            for row, job in batches.lines_in_order(session, batch.id):
                yield self._line(batch, row, job, outcome)
                written += 1
                if written % RENEW_EVERY_LINES == 0:
                    self._renew(batch.id)
        if not batch.read_done:
            yield from self._unread(batch, outcome)

    def _line(self, batch: Batch, row: Row[Any], job: Row[Any] | None, outcome: _Outcome,
              ) -> tuple[bool, dict[str, Any]]:
        manifest = outcome.manifest
        manifest.total += 1
        meta = (job.meta if job is not None else None) or {}
        custom_id = row.custom_id or (row.error or {}).get("custom_id")
        if row.status == LINE_SUCCEEDED and job is not None:
            manifest.record_completed(job.prompt_tokens or 0, job.completion_tokens or 0)
            return True, self._result_line(str(custom_id), job, meta)
        code, message = _error_of(row, job)
        if code == LINE_CANCELLED_CODE:
            manifest.record_cancelled()
        else:
            manifest.record_failed()
        return False, _error_line(batch, custom_id, row.line, code, message, refused=row.error is not None)

    def _result_line(self, custom_id: str, job: Row[Any], meta: dict[str, Any]) -> dict[str, Any]:
        model = meta.get("model") or job_model_id(job.queue, job.params)
        if meta.get("endpoint") == EMBEDDINGS:
            assert job.embeddings is not None, "a succeeded embedding job holds its vectors"
            vectors, encoding_format = job.embeddings, JobParams.from_stored(job.params).encoding_format
            body = embedding_list(vectors, encoding_format, model, job.prompt_tokens or 0)
            return batch_result_line(custom_id, body, line_id=new_id("batch_req_"), request_id=job.id)
        finished = job.finished_at or utcnow()
        result = GenerationResult(text=job.result_text or "", finish_reason=job.finish_reason or "stop",
                                  prompt_tokens=job.prompt_tokens or 0,
                                  completion_tokens=job.completion_tokens or 0,
                                  model=model,
                                  created=int(finished.timestamp()), logprobs=job.logprobs,
                                  cached_tokens=job.cached_tokens or 0, draft_tokens=job.draft_tokens or 0,
                                  accepted_draft_tokens=job.accepted_draft_tokens or 0,
                                  chat=ChatOptions.from_json(job.chat),
                                  job_id=job.id, choices=job.choices, prompt=job.prompt or "",
                                  prompt_logprobs=job.prompt_logprobs,
                                  shown=PromptView.from_json(meta.get("shown")),
                                  service_tier=meta.get("service_tier"))
        if meta.get("endpoint") == MESSAGES:  # its id is its job's, as POST /v1/messages gives it
            stop_sequences = JobParams.from_stored(job.params).stop_strings()  # cut off the text's end
            return succeeded_line(custom_id, message_object(result, message_id(job.id), stop_sequences))
        if meta.get("endpoint", CHAT) == CHAT:
            body = chat_completion(result, new_id("chatcmpl-"))
        else:
            body = text_completion(result, new_id("cmpl-"))
        return batch_result_line(custom_id, body, line_id=new_id("batch_req_"), request_id=job.id)

    def _unread(self, batch: Batch, outcome: _Outcome) -> Iterator[tuple[bool, dict[str, Any]]]:
        """Lines the reading never reached: each becomes a cancelled (or expired) error line."""
        code = LINE_EXPIRED_CODE if batch.stop_reason == STOP_EXPIRED else LINE_CANCELLED_CODE
        message = {LINE_EXPIRED_CODE: "the batch expired before this line ran",
                   LINE_CANCELLED_CODE: "the batch was cancelled before this line ran"}[code]
        if batch.stop_reason == STOP_FAILED:
            return  # the input could not be read
        start = ReadPosition(batch.read_line, batch.read_offset)
        try:
            lines = open_input(batch.input_url, start, s3=self._s3,
                               max_line_bytes=self._settings.batch_max_line_bytes)
            with lines:
                for number, raw in lines:
                    outcome.unread += 1
                    outcome.manifest.total += 1
                    outcome.manifest.record_cancelled()
                    yield False, _error_line(batch, _custom_id_of(raw), number, code, message, refused=False)
        except (OSError, ClientError, BotoCoreError) as exc:  # the input is gone: list what was read
            log.warning("batch %s: lines never read cannot be listed (%s)", batch.id, type(exc).__name__)

    def _renew(self, batch_id: str) -> None:
        with self._sessions() as session:
            if not batches.take_lease(session, batch_id, self._owner, utcnow(),
                                      self._settings.worker_dead_after_s):
                raise LeaseLostError(batch_id)

    # --- closing ----------------------------------------------------------------------------------

    def _close(self, batch: Batch, status: str, outcome: _Outcome, outputs: dict[str, str],
               new_files: list[File | None], errors: list[dict[str, Any]] | None = None) -> str | None:
        now = utcnow()
        output_file, error_file = new_files if new_files else (None, None)
        with self._sessions() as session:
            closed = batches.finish(session, batch.id, self._owner, now, status=status, unread=outcome.unread,
                                    outputs=outputs or None,
                                    output_file_id=output_file.id if output_file else None,
                                    error_file_id=error_file.id if error_file else None, errors=errors)
            if closed is None:
                log.warning("batch %s: lease lost before closing; outputs are rewritten by the new holder",
                            batch.id)
                return None
            for row in (output_file, error_file):
                if row is not None:
                    files.add(session, row)
            if status in _EVENTS:
                webhook_events.enqueue_batch_event(session, batch_public(closed), _EVENTS[status],
                                                   closed.tenant_id, closed.webhook, now)
            session.commit()
        log.info("batch %s %s: %s", batch.id, status, outcome.manifest.to_dict()["request_counts"])
        return status


def _error_line(batch: Batch, custom_id: str | None, line: int, code: str, message: str, *, refused: bool,
                ) -> dict[str, Any]:
    """The output line of a line that did not succeed, as the batch's endpoint renders it; `refused`: the
    request rules refused it (else it was cut short, or failed while it ran)."""
    if batch.endpoint == MESSAGES:
        return unsucceeded_line(batch, custom_id, code, message, refused=refused)
    return batch_error_line(custom_id, line=line, code=code, message=message, line_id=new_id("batch_req_"))


def _error_of(row: Row[Any], job: Row[Any] | None) -> tuple[str, str]:
    if row.error is not None:
        return str(row.error["code"]), str(row.error["message"])
    if row.status == LINE_CANCELLED or job is None or job.status in ("scheduled", "queued", "running"):
        return LINE_CANCELLED_CODE, "the batch was cancelled before this line finished"
    return job.error_code or "failed", job.error_message or "the request failed"


def _custom_id_of(raw: object) -> str | None:
    """Best effort, for lines never parsed: their custom_id when the line is a JSON object with one."""
    if not isinstance(raw, bytes):
        return None
    try:
        line = json.loads(raw)
    except ValueError:
        return None
    custom_id = line.get("custom_id") if isinstance(line, dict) else None
    return custom_id if isinstance(custom_id, str) else None


def _ts(when: datetime | None) -> float | None:
    return None if when is None else when.timestamp()


