"""A background loop on its own named thread: how every long-lived thread of the API and the workers starts
and stops.

Two shapes. `BackgroundLoop.every(name, interval_s, tick)` calls `tick()` every interval_s (the first one
interval after start) until stopped; an exception is handed to `on_error` (by default logged with its
traceback) and the next tick runs. `BackgroundLoop(name, run, wake=...)` runs `run(stop)` once: the loop
function itself decides when it returns, on the `stop` Event or on a marker that `wake` puts in its inbox
(an inbox loop blocks on its queue, not on the Event). An exception escaping `run` ends the thread and is
logged.

`stop()` is `request_stop()` then `join()`; the two halves are apart for owners that must stop a loop early
and wait for it later (the job runner stops watching before it waits for its in-flight work).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

Tick = Callable[[], None]
OnError = Callable[[Exception], None]


class BackgroundLoop:
    def __init__(self, name: str, run: Callable[[threading.Event], None], *,
                 wake: Callable[[], None] | None = None, daemon: bool = True) -> None:
        """`wake`: called by request_stop() while the thread runs, to unblock a loop that does not wait on
        the Event (e.g. put its stop marker in its inbox)."""
        self.name = name
        self._run = run
        self._wake = wake
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=daemon)

    @classmethod
    def every(cls, name: str, interval_s: float, tick: Tick, *, on_error: OnError | None = None,
              daemon: bool = True) -> BackgroundLoop:
        """A loop that calls `tick()` every `interval_s` until stopped (a stop ends the wait at once)."""
        handle_error = on_error if on_error is not None else _log_failed_tick(name)

        def run(stop: threading.Event) -> None:
            while not stop.wait(interval_s):
                try:
                    tick()
                except Exception as exc:
                    handle_error(exc)

        return cls(name, run, daemon=daemon)

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    @property
    def stopping(self) -> bool:
        """Whether a stop was requested (the loop may still be finishing its round)."""
        return self._stop.is_set()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def request_stop(self) -> None:
        """Asks the loop to end, without waiting for it. Idempotent."""
        self._stop.set()
        if self._wake is not None and self._thread.is_alive():
            self._wake()

    def join(self, timeout_s: float | None = None) -> bool:
        """Waits (at most timeout_s; None: for as long as it takes) for a started loop to end. True when no
        loop is running any more."""
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def stop(self, timeout_s: float | None = None) -> bool:
        """request_stop() then join(timeout_s)."""
        self.request_stop()
        return self.join(timeout_s)

    def _main(self) -> None:
        try:
            self._run(self._stop)
        except Exception:
            log.exception("background loop %s ended on an error", self.name)


def _log_failed_tick(name: str) -> OnError:
    def log_it(_exc: Exception) -> None:
        log.exception("background loop %s: a round failed; trying again next round", name)

    return log_it
