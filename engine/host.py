"""EngineHost: one LLMEngine stepping in a background thread, behind a thread-safe submit/cancel API.

Only the engine thread touches the engine's state. Callers validate and build their Sequence in their own
thread (so bad input raises there, synchronously), then hand it over through a lock-protected inbox; the
engine thread sleeps on a Condition when it has nothing to do. A constrained request whose grammar is not
cached goes to the inbox only once a compile thread has compiled it
(engine/structured_output/compile_queue.py): submit never compiles, so neither the caller nor the engine
thread waits for a costly schema, and a constraint that cannot be compiled fails that request's future with a
ValueError.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from conveyor.engine.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.pooling_params import PoolingParams
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.sequence import Sequence, Urgency
from conveyor.engine.structured_output.compile_queue import GrammarQueue
from conveyor.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

OnUpdate = Callable[[RequestOutput], None]
OnStepEnd = Callable[[], None]
OnFinished = Callable[[str, RequestOutput], None]  # (request class, its final output)
OnAdmitted = Callable[[], None]  # the request is in the engine's inbox (its grammar, if any, compiled)


class EngineShutdownError(RuntimeError):
    """Set on futures still outstanding when the host shuts down."""


@dataclass
class _Pending:
    future: Future[RequestOutput]
    on_update: OnUpdate | None
    request_class: str
    on_admitted: OnAdmitted | None = None


class EngineHost:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._inbox: list[Sequence] = []  # submitted, not yet handed to the engine
        self._cancels: list[str] = []
        self._commands: list[tuple[Callable[[], None], Future[None]]] = []  # run between steps
        self._pending: dict[str, _Pending] = {}  # every request whose future is unresolved
        self._compiling: dict[str, Sequence] = {}  # pending requests waiting for their grammar
        self._grammars = GrammarQueue(self._compile_grammar)
        self._stopping = False
        self._stats = engine.stats()
        self._step_listeners: list[OnStepEnd] = []
        self._finish_listeners: list[OnFinished] = []
        self._thread = threading.Thread(target=self._loop, name="engine-host", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> EngineHost:
        return cls(LLMEngine(config))

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    # --- caller side ---------------------------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        request_class: str | None = None,
        on_update: OnUpdate | None = None,
        *,
        cache_salt: str | None = None,
        on_admitted: OnAdmitted | None = None,
        urgency: Urgency | None = None,
        lora: str | None = None,
    ) -> Future[RequestOutput]:
        """Raises ValueError here, in the caller, for invalid input; the future resolves when it finishes.
        `request_class` None: the engine's default class (its first configured one). `on_admitted` is
        called once the request is handed to the engine: before submit returns, or on the compile thread
        once its grammar compiled (not if the compile fails: the future fails instead). `urgency`: its
        priority and deadline within its class. `params`: PoolingParams for an embedding engine (the
        future's output then has `embedding`), SamplingParams for a generation one; the other kind is a
        ValueError. `lora`: a loaded adapter's name (`add_lora`)."""
        seq = self.engine.make_sequence(request_id, prompt, params, request_class, cache_salt=cache_salt,
                                        urgency=urgency, attach_grammar=False, lora=lora)
        ready = self.engine.attach_grammar(seq, compile=False)  # a cache hit, or a refusal, right here
        future: Future[RequestOutput] = Future()
        future.set_running_or_notify_cancel()  # cancel through cancel(), which also frees the KV blocks
        with self._cond:
            if self._stopping:
                raise RuntimeError("EngineHost is shut down")
            if request_id in self._pending:
                raise ValueError(f"request_id {request_id!r} is already running or waiting")
            self._pending[request_id] = _Pending(future, on_update, seq.request_class, on_admitted)
            if ready:
                self._inbox.append(seq)
                self._cond.notify()
            else:
                self._compiling[request_id] = seq
        if not ready:
            self._grammars.submit(seq, cache_salt, self._grammar_compiled)
        elif on_admitted is not None:
            on_admitted()
        return future

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        request_class: str | None = None,
        on_update: OnUpdate | None = None,
        *,
        cache_salt: str | None = None,
    ) -> RequestOutput:
        return await asyncio.wrap_future(
            self.submit(request_id, prompt, params, request_class, on_update, cache_salt=cache_salt)
        )

    def add_lora(self, name: str, path: str) -> Future[None]:
        """Loads a PEFT adapter on the engine thread, between steps; the future fails with the engine's
        ValueError when it is refused."""
        return self._on_engine_thread(lambda: self.engine.add_lora(name, path))

    def remove_lora(self, name: str) -> Future[None]:
        """Unloads an adapter between steps; refused (ValueError) while requests that name it are
        unfinished."""
        return self._on_engine_thread(lambda: self.engine.remove_lora(name))

    def _on_engine_thread(self, command: Callable[[], None]) -> Future[None]:
        future: Future[None] = Future()
        with self._cond:
            if self._stopping:
                raise RuntimeError("EngineHost is shut down")
            self._commands.append((command, future))
            self._cond.notify()
        return future

    def cancel(self, request_id: str) -> bool:
        """Aborts within a step and frees its KV blocks; the future resolves with finish_reason "abort"."""
        with self._cond:
            if request_id not in self._pending or self._stopping:
                return False
            seq = self._compiling.pop(request_id, None)
            if seq is not None:  # aborted before any step, like any cancel; its compile's result is dropped
                self._grammars.discard(request_id)
                self._inbox.append(seq)
            self._cancels.append(request_id)
            self._cond.notify()
            return True

    def on_step_end(self, listener: OnStepEnd) -> None:
        """Calls `listener` on the engine thread after each step's outputs are delivered (callers that group
        their work per step flush there). Register before submitting work."""
        with self._cond:
            self._step_listeners.append(listener)

    def remove_step_listener(self, listener: OnStepEnd) -> None:
        with self._cond:
            if listener in self._step_listeners:
                self._step_listeners.remove(listener)

    def on_request_finished(self, listener: OnFinished) -> None:
        """Calls `listener(request class, output)` on the engine thread once per request that finishes
        (stop, length or abort) before its future resolves: observers read its metrics there, once."""
        with self._cond:
            self._finish_listeners.append(listener)

    def stats(self) -> dict[str, object]:
        with self._cond:
            return dict(self._stats)

    def shutdown(self, wait: bool = True) -> None:
        """Stops the thread after its current step; outstanding futures fail with EngineShutdownError."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    # --- compile thread ------------------------------------------------------------------------------

    def _compile_grammar(self, seq: Sequence) -> None:
        self.engine.attach_grammar(seq, compile=True)

    def _grammar_compiled(self, seq: Sequence, error: Exception | None) -> None:
        """Hands a compiled request to the engine, or fails it; nothing for one cancelled meanwhile (cancel
        handed it over already) or failed by shutdown."""
        request_id = seq.request_id
        with self._cond:
            if self._compiling.get(request_id) is not seq or self._stopping:
                return
            del self._compiling[request_id]
            pending = self._pending[request_id]
            if error is None:
                self._inbox.append(seq)
                self._cond.notify()
        if error is not None:
            self._fail([request_id], error)
        elif pending.on_admitted is not None:
            try:
                pending.on_admitted()
            except Exception:  # a caller's callback must not stop the compiles
                log.exception("on_admitted callback failed for %s", request_id)

    # --- engine thread -------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while self._wait_for_work():
                self._step_once()
        except Exception:
            log.exception("engine host thread stopped on an unexpected error")
        finally:
            self._fail_all(EngineShutdownError("EngineHost shut down before the request finished"))
            self._grammars.shutdown(wait=False)
            self.engine.close()

    def _wait_for_work(self) -> bool:
        """Blocks until there is something to do; False when shutting down."""
        with self._cond:
            while not self._has_work():
                self._cond.wait()
            return not self._stopping

    def _has_work(self) -> bool:
        return (self._stopping or bool(self._inbox or self._cancels or self._commands)
                or self.engine.has_unfinished_requests())

    def _step_once(self) -> None:
        self._take_inbox()
        try:
            outputs = self.engine.step()
        except Exception as exc:  # engine state unknown: abort everything it holds, keep serving
            log.exception("engine step failed")
            self._fail(self._abort_all_in_engine(), exc)
            outputs = []
        # The step already aborted these (their "abort" outputs are in `outputs`): fail them with the cause
        # first, so _deliver finds them resolved and skips them.
        for error in self.engine.last_failures:
            self._fail(error.request_ids, error.__cause__ or error)
        self._deliver(outputs)
        with self._cond:
            self._stats = self.engine.stats()
            listeners = list(self._step_listeners)
        for listener in listeners:
            try:
                listener()
            except Exception:  # a caller's callback must not stop the engine
                log.exception("step-end listener failed")

    def _take_inbox(self) -> None:
        with self._cond:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
            commands, self._commands = self._commands, []
        for command, done in commands:  # first: a request queued after an add_lora may name the adapter
            try:
                command()
            except Exception as exc:  # refused (ValueError), or failed reading the adapter
                done.set_exception(exc)
            else:
                done.set_result(None)
        for seq in inbox:
            try:
                self.engine.enqueue(seq)
            except ValueError as exc:
                self._fail([seq.request_id], exc)
        for request_id in cancels:
            self.engine.abort_request(request_id)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._cond:
                pending = self._pending.get(out.request_id)
                if out.finished:
                    self._pending.pop(out.request_id, None)
            if pending is None:
                continue
            if pending.on_update is not None:
                try:
                    pending.on_update(out)
                except Exception:  # a caller's callback must not stop the engine
                    log.exception("on_update callback failed for %s", out.request_id)
            if out.finished:
                self._tell_finished(pending.request_class, out)
                pending.future.set_result(out)

    def _tell_finished(self, request_class: str, out: RequestOutput) -> None:
        with self._cond:
            listeners = list(self._finish_listeners)
        for listener in listeners:
            try:
                listener(request_class, out)
            except Exception:  # an observer must not stop the engine
                log.exception("request-finished listener failed for %s", out.request_id)

    def _fail(self, request_ids: list[str], exc: BaseException) -> None:
        for request_id in request_ids:
            with self._cond:
                pending = self._pending.pop(request_id, None)
            if pending is not None:
                pending.future.set_exception(exc)

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            self._stopping = True
            self._inbox.clear()
            commands, self._commands = self._commands, []
        for _, done in commands:
            done.set_exception(exc)
        with self._cond:
            request_ids = list(self._pending)
        self._fail(request_ids, exc)

    def _abort_all_in_engine(self) -> list[str]:
        """Aborts every request the engine holds; returns their ids (not those still in the inbox)."""
        with self._cond:
            candidates = list(self._pending)
        aborted = []
        for request_id in candidates:
            try:
                if self.engine.abort_request(request_id):
                    aborted.append(request_id)
            except Exception:
                log.exception("could not abort %s after a failed step", request_id)
                aborted.append(request_id)
        return aborted
