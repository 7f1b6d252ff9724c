"""Grammar compiles off the submitting thread: one compile thread, taking the waiting owners in turn.

A request whose constraint is not cached waits here, outside the engine (it holds no scheduler slot and no
KV block), while requests that need no compile go straight on. Owners are opaque keys (EngineHost passes the
request's cache salt, which the service sets per tenant): each turn compiles one request of the owner that
waited longest, so an owner with a hundred costly schemas delays another owner's one compile by at most one
compile (itself bounded by the engine's grammar_compile_timeout_s).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from conveyor.engine.sequence import Sequence

log = logging.getLogger(__name__)

Compile = Callable[[Sequence], None]  # attaches the grammar to the sequence, or raises
Done = Callable[[Sequence, Exception | None], None]  # told on the compile thread, once per request


@dataclass
class _Waiting:
    seq: Sequence
    done: Done


class GrammarQueue:
    def __init__(self, compile: Compile) -> None:
        self._compile = compile
        self._cond = threading.Condition()
        self._waiting: OrderedDict[str | None, deque[_Waiting]] = OrderedDict()  # owner -> its requests
        self._stopping = False
        self._thread: threading.Thread | None = None  # started by the first request

    def submit(self, seq: Sequence, owner: str | None, done: Done) -> None:
        """Compiles seq's constraint in turn; `done(seq, None)` once attached, `done(seq, error)` if not."""
        with self._cond:
            if self._stopping:
                raise RuntimeError("the grammar queue is shut down")
            self._waiting.setdefault(owner, deque()).append(_Waiting(seq, done))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="grammar-compile", daemon=True)
                self._thread.start()
            self._cond.notify()

    def discard(self, request_id: str) -> None:
        """Drops a request that has not begun compiling (its `done` is never called); one compiling now
        finishes, and its caller ignores the outcome."""
        with self._cond:
            for owner, requests in list(self._waiting.items()):
                kept = deque(item for item in requests if item.seq.request_id != request_id)
                if not kept:
                    del self._waiting[owner]
                elif len(kept) != len(requests):
                    self._waiting[owner] = kept

    def shutdown(self, wait: bool = True) -> None:
        """Drops what waits (its requests are failed by the host) and stops after the compile in progress;
        `wait`: until then."""
        with self._cond:
            self._stopping = True
            self._waiting.clear()
            self._cond.notify()
            thread = self._thread
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()

    def _loop(self) -> None:
        while (item := self._next()) is not None:
            error: Exception | None = None
            try:
                self._compile(item.seq)
            except Exception as exc:  # the request's error, told to its caller
                error = exc
            try:
                item.done(item.seq, error)
            except Exception:  # a caller's callback must not stop the compiles
                log.exception("grammar compile callback failed for %s", item.seq.request_id)

    def _next(self) -> _Waiting | None:
        """The oldest request of the owner that waited longest; the owner goes to the back of the line."""
        with self._cond:
            while not self._waiting and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            owner, requests = next(iter(self._waiting.items()))
            item = requests.popleft()
            del self._waiting[owner]
            if requests:
                self._waiting[owner] = requests
            return item
