"""Traffic: jobs submitted over HTTP at a steady rate, one Idempotency-Key per job, retried with the same key
whenever the answer was lost or the service could not take it (connection error, 5xx, 429)."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.support.fault_store import WAIT_S, wait_until

RETRY_STATUSES = {429, 500, 502, 503, 504}


@dataclass
class Submission:
    key: str
    body: dict[str, Any]
    codes: list[int | str] = field(default_factory=list)  # every answer: an HTTP status or an error name
    job_id: str | None = None
    accepted_code: int | None = None  # 202 (created) or 200 (a replay of the same key)
    refusal: Any = None  # the body of a final 4xx
    gave_up: bool = False


class Traffic:
    """Submits jobs at a steady rate from a few threads, each with its own Idempotency-Key. A submission is
    retried with the same key until the API accepts it (2xx) when the answer was lost (connection error,
    timeout) or the service could not take it (429, 5xx), for at most `retry_for_s`."""

    def __init__(self, base_url: str, *, rate: float, body: Callable[[int], dict[str, Any]] | None = None,
                 concurrency: int = 8, retry_for_s: float = 180.0, prefix: str = "t") -> None:
        self.base_url = base_url
        self.rate = rate
        self.body = body or (lambda i: short_job(f"job {i}"))
        self.concurrency = concurrency
        self.retry_for_s = retry_for_s
        self.prefix = prefix
        self.submissions: list[Submission] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._abort = threading.Event()  # set at teardown: retrying submissions give up at once
        self._slots = threading.Semaphore(concurrency)
        self._threads: list[threading.Thread] = []
        self._pacer: threading.Thread | None = None
        self._http = httpx.Client(timeout=httpx.Timeout(10.0, connect=2.0))

    # one submission, retried with its key until accepted ------------------------------------------------

    def submit(self, body: dict[str, Any], key: str | None = None) -> Submission:
        sub = Submission(key or f"{self.prefix}-{uuid.uuid4().hex}", body)
        with self._lock:
            self.submissions.append(sub)
        self._run(sub)
        return sub

    def _run(self, sub: Submission) -> None:
        deadline = time.monotonic() + self.retry_for_s
        pause = 0.2
        while not self._abort.is_set():
            try:
                response = self._http.post(f"{self.base_url}/v1/jobs", json=sub.body,
                                           headers={"Idempotency-Key": sub.key})
            except httpx.HTTPError as exc:  # the request or its answer was lost: retry with the same key
                sub.codes.append(type(exc).__name__)
            else:
                sub.codes.append(response.status_code)
                if response.status_code in (200, 202):
                    sub.job_id = response.json()["id"]
                    sub.accepted_code = response.status_code
                    return
                if response.status_code not in RETRY_STATUSES:
                    sub.gave_up = True  # a 4xx: the test decides what that means
                    with contextlib.suppress(ValueError):
                        sub.refusal = response.json()
                    return
            if time.monotonic() > deadline:
                sub.gave_up = True
                return
            self._abort.wait(pause)
            pause = min(pause * 1.5, 1.0)
        sub.gave_up = True

    # steady traffic --------------------------------------------------------------------------------------

    def start(self) -> Traffic:
        self._pacer = threading.Thread(target=self._pace, name="traffic", daemon=True)
        self._pacer.start()
        return self

    def _pace(self) -> None:
        interval = 1.0 / self.rate
        next_at = time.monotonic()
        i = 0
        while not self._stop.is_set():
            delay = next_at - time.monotonic()
            if delay > 0 and self._stop.wait(delay):
                break
            self._slots.acquire()  # at most `concurrency` submissions in flight (retrying ones included)
            if self._stop.is_set():
                self._slots.release()
                break
            body = self.body(i)
            i += 1
            thread = threading.Thread(target=self._one, args=(body,), daemon=True)
            self._threads.append(thread)
            thread.start()
            next_at = max(next_at + interval, time.monotonic() - 1.0)  # no burst to catch up after a stall

    def _one(self, body: dict[str, Any]) -> None:
        try:
            self.submit(body)
        finally:
            self._slots.release()

    def stop(self, wait_s: float = 240.0) -> Traffic:
        """Stops submitting new jobs and waits for the ones in flight (still retrying) to settle."""
        self._stop.set()
        if self._pacer is not None:
            self._pacer.join(timeout=10)
        deadline = time.monotonic() + wait_s
        for thread in list(self._threads):
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        print(self.summary())  # shown with a failed test's captured output
        return self

    def close(self) -> None:
        """Stops everything at once (teardown): no submission of this traffic may reach the next test."""
        self._stop.set()
        self._abort.set()
        if self._pacer is not None:
            self._pacer.join(timeout=10)
        for thread in list(self._threads):
            thread.join(timeout=15)
        self._http.close()

    # waits on what the traffic has done, instead of fixed sleeps -----------------------------------------

    def wait_submitted(self, n: int, timeout_s: float = WAIT_S) -> None:
        """Waits until `n` more submissions were made than when called: the traffic went on for a while."""
        target = self._count(lambda s: True) + n
        wait_until(lambda: self._count(lambda s: True) >= target,
                   f"{n} more submissions of traffic {self.prefix}", timeout_s)

    def wait_accepted(self, n: int, timeout_s: float = WAIT_S) -> None:
        """Waits until `n` more submissions were accepted than when called: the service takes jobs."""
        target = self._count(lambda s: s.job_id is not None) + n
        wait_until(lambda: self._count(lambda s: s.job_id is not None) >= target,
                   f"{n} more accepted submissions of traffic {self.prefix}", timeout_s)

    def wait_lost_answer(self, timeout_s: float = 30.0) -> None:
        """Waits until some submission's answer was lost (a connection error, retried with its key)."""
        wait_until(lambda: self._count(lambda s: any(isinstance(c, str) for c in s.codes)) > 0,
                   f"a lost answer in traffic {self.prefix}", timeout_s)

    def _count(self, counted: Callable[[Submission], bool]) -> int:
        with self._lock:
            return sum(1 for s in self.submissions if counted(s))

    # what happened ---------------------------------------------------------------------------------------

    def accepted(self) -> dict[str, str]:
        """Idempotency-Key -> job id of every accepted submission."""
        with self._lock:
            return {s.key: s.job_id for s in self.submissions if s.job_id is not None}

    def answers(self) -> Counter[int | str]:
        with self._lock:
            return Counter(code for s in self.submissions for code in s.codes)

    def unsettled(self) -> list[Submission]:
        with self._lock:
            return [s for s in self.submissions if s.job_id is None]

    def summary(self) -> str:
        """One line for the test's captured output: how much traffic there was and what it was answered."""
        with self._lock:
            n, accepted = len(self.submissions), sum(1 for s in self.submissions if s.job_id)
            replays = sum(1 for s in self.submissions if s.accepted_code == 200)
        return (f"traffic {self.prefix}: {n} submitted, {accepted} accepted ({replays} replays): "
                f"{self.answers()}")


def short_job(prompt: str, max_tokens: int = 8, **fields: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields}


def long_job(prompt: str, max_tokens: int, **fields: Any) -> dict[str, Any]:
    """A job that generates exactly max_tokens tokens (EOS ignored): long enough to be caught running."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **fields}
