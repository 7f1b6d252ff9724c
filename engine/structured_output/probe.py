"""A child process that test-compiles each new grammar under a hard time and memory limit.

xgrammar cannot stop a compile it has begun, and some schemas of a few KB take minutes and hundreds of MB
(thousands of optional properties, say). A thread could give up waiting, but the compile would go on eating
a core and memory. So a new constraint is first compiled here, in a process that is killed when it runs past
the deadline (and that cannot allocate past its memory limit); only what compiled in time is then compiled
again in the engine's process, where the matcher must live. A compiled grammar cannot come back instead:
xgrammar's serialized form grows quadratically (356 MB of JSON for a 4 MB grammar of 1,000 properties).

The protocol is JSON lines. Parent to child: first {"tokenizer_info": ..., "memory_bytes": ...}, then one
StructuredOutput's fields per line. Child to parent: {"ready": true} once, then per request one of
{"ok": true}, {"ok": false, "out_of_memory": true} or {"ok": false, "error": "..."}.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import resource
import subprocess
import sys
import threading
import weakref
from typing import IO, Any

from conveyor.engine.structured_output.constraint import GrammarLimitError, StructuredOutput

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0  # the child imports xgrammar (and torch with it): seconds on a busy machine
CHILD_MODULE = "conveyor.engine.structured_output.probe"


class _Child:
    """One running probe process and the thread that reads its answers."""

    def __init__(self, setup: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", CHILD_MODULE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, encoding="utf-8", bufsize=1,
        )
        self.answers: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()  # None: it exited
        assert self.process.stdout is not None
        threading.Thread(target=self._read, args=(self.process.stdout,), name="grammar-probe-reader",
                         daemon=True).start()
        self.ready = False
        # A probe dropped without close() (an engine a test let go) must not leave its process behind.
        weakref.finalize(self, self.process.kill)
        self.send(setup)

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def answer(self, timeout_s: float) -> dict[str, Any] | None:
        """The next answer; None if the child exited. queue.Empty once timeout_s passes."""
        return self.answers.get(timeout=timeout_s)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            try:
                self.answers.put(json.loads(line))
            except json.JSONDecodeError:
                log.warning("grammar probe wrote a line that is not JSON: %.200s", line)
        self.answers.put(None)


class GrammarProbe:
    """Test-compiles constraints in a child process, one at a time, each under `timeout_s`.

    The child starts at construction (its start-up is not part of any compile's deadline) and is replaced
    after each kill. Thread-safe: callers take turns.
    """

    def __init__(self, tokenizer_info_json: str, timeout_s: float, memory_bytes: int) -> None:
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self._setup = json.dumps({"tokenizer_info": tokenizer_info_json, "memory_bytes": memory_bytes})
        self._lock = threading.Lock()
        self._child: _Child | None = _Child(self._setup)
        self._closed = False
        self.num_kills = 0

    def check(self, structured: StructuredOutput) -> None:
        """Returns once the constraint compiled within the limits; GrammarLimitError past the time or memory
        limit, ValueError naming the field if xgrammar rejects it."""
        with self._lock:
            child = self._sent(json.dumps(dataclasses.asdict(structured)))
            try:
                answer = child.answer(self.timeout_s)
            except queue.Empty:
                self._replace(child)
                raise GrammarLimitError(
                    f"structured.{structured.kind} did not compile within {self.timeout_s:g} s "
                    "(grammar_compile_timeout_s)"
                ) from None
            if answer is None and self._closed:
                raise RuntimeError("the grammar probe is closed")
            if answer is None:  # a crash (the stack, or memory the limit let the allocator promise)
                self._replace(child)
                raise GrammarLimitError(f"structured.{structured.kind} could not be compiled: the compile "
                                        "process crashed")
        if answer.get("out_of_memory"):
            raise GrammarLimitError(f"structured.{structured.kind} could not be compiled within "
                                    f"{self._memory_limit}")
        if not answer.get("ok"):
            raise ValueError(str(answer.get("error")))

    @property
    def _memory_limit(self) -> str:
        return f"{self.memory_bytes / 2**20:.0f} MiB (grammar_compile_memory_bytes)"

    def close(self) -> None:
        """Kills the child, without waiting for a compile in progress (which then raises RuntimeError)."""
        self._closed = True
        child = self._child
        if child is not None:
            child.kill()

    def _sent(self, request: str) -> _Child:
        """The child `request` went to; one that died since its last answer (the kernel's OOM killer, say)
        is replaced first."""
        child = self._ready_child()
        try:
            child.send(request)
        except OSError:
            self._replace(child)
            child = self._ready_child()
            child.send(request)
        return child

    def _ready_child(self) -> _Child:
        if self._closed:
            raise RuntimeError("the grammar probe is closed")
        child = self._child if self._child is not None else _Child(self._setup)
        self._child = child
        if not child.ready:
            try:
                hello = child.answer(STARTUP_TIMEOUT_S)
            except queue.Empty:
                hello = None
            if hello is None or not hello.get("ready"):
                self._replace(child)
                raise RuntimeError(f"the grammar probe process did not start: {hello}")
            child.ready = True
        return child

    def _replace(self, child: _Child) -> None:
        """Kills `child` and starts the next one now, so it is ready by the next request."""
        child.kill()
        self.num_kills += 1
        self._child = None if self._closed else _Child(self._setup)


# --- the child ---------------------------------------------------------------------------------------


def _serve(stdin: IO[str], stdout: IO[str]) -> None:
    import xgrammar as xgr

    from conveyor.engine.structured_output.grammar import compile_structured

    setup = json.loads(stdin.readline())
    info = xgr.TokenizerInfo.deserialize_json(setup["tokenizer_info"])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _limit_memory(int(setup["memory_bytes"]))
    _answer(stdout, {"ready": True})
    for line in stdin:
        try:
            compiled = compile_structured(compiler, StructuredOutput(**json.loads(line)))
        except MemoryError:
            _answer(stdout, {"ok": False, "out_of_memory": True})
            continue
        except ValueError as exc:  # xgrammar's C++ reports its failed allocations as std::bad_alloc
            _answer(stdout, {"ok": False, "out_of_memory": True} if "bad_alloc" in str(exc)
                    else {"ok": False, "error": str(exc)})
            continue
        del compiled
        _answer(stdout, {"ok": True})


def _limit_memory(memory_bytes: int) -> None:
    """Caps the address space at what the child holds now plus `memory_bytes`."""
    with open(f"/proc/{os.getpid()}/statm") as statm:
        current = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (current + memory_bytes, current + memory_bytes))


def _answer(stdout: IO[str], message: dict[str, Any]) -> None:
    stdout.write(json.dumps(message) + "\n")
    stdout.flush()


if __name__ == "__main__":
    _serve(sys.stdin, sys.stdout)
