"""A small synchronous client for the Conveyor REST API (used by `conveyor submit|status|wait|cancel`)."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

TERMINAL = frozenset({"succeeded", "failed", "cancelled", "expired"})
TRIES = 4  # a submit, or one long poll, whose answer was lost
LONG_POLL_S = 30.0  # each `GET ?wait=`: under the API's 60 s cap and under common proxy idle timeouts
ANSWER_MARGIN_S = 10.0  # beyond `wait`, how long one long poll may take to answer before it is an error
MIN_WAIT_S = 0.001  # the API refuses wait=0
EARLY_ANSWER_PAUSE_S = 0.5
RETRIED_STATUSES = frozenset({502, 503, 504})  # the API or a proxy in front of it could not answer


class ClientError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        error = body.get("error", {}) if isinstance(body, dict) else {}
        super().__init__(f"HTTP {status}: {error.get('message', body)}")
        self.status = status
        self.body = body


class ConveyorClient:
    def __init__(self, http: httpx.Client) -> None:
        self.http = http

    @classmethod
    def connect(cls, url: str, api_key: str | None = None, timeout_s: float = 30.0) -> ConveyorClient:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return cls(httpx.Client(base_url=url, headers=headers, timeout=timeout_s))

    def submit(self, body: dict[str, Any], idempotency_key: str | None = None) -> dict[str, Any]:
        """Submits a job, always with an Idempotency-Key (a fresh one unless given), so that when the answer
        is lost (connection dropped, API restarted, 502/503/504) the retry returns the job the first try
        created instead of creating and running a second one."""
        headers = {"Idempotency-Key": idempotency_key or new_idempotency_key()}
        return self._retrying(lambda: self._json(self.http.post("/v1/jobs", json=body, headers=headers)))

    def get(self, job_id: str, wait_s: float | None = None) -> dict[str, Any]:
        """The job; with `wait_s`, a long poll: answered once the job is final or after wait_s."""
        if wait_s is None:
            return self._json(self.http.get(f"/v1/jobs/{job_id}"))
        wait_s = max(wait_s, MIN_WAIT_S)
        return self._json(self.http.get(f"/v1/jobs/{job_id}", params={"wait": f"{wait_s:.3f}"},
                                        timeout=wait_s + ANSWER_MARGIN_S))

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._json(self.http.post(f"/v1/jobs/{job_id}/cancel"))

    def retry(self, job_id: str, schedule: dict[str, Any] | None = None, idempotency_key: str | None = None,
              ) -> dict[str, Any]:
        """Runs a failed, cancelled or expired job again, with an Idempotency-Key (a fresh one unless given),
        so a retried call whose answer was lost does not run the job twice."""
        headers = {"Idempotency-Key": idempotency_key or new_idempotency_key()}
        return self._retrying(lambda: self._json(
            self.http.post(f"/v1/jobs/{job_id}/retry", json=schedule or None, headers=headers)))

    def purge(self, queue: str, model: str | None = None) -> dict[str, Any]:
        params = {"model": model} if model is not None else None
        return self._json(self.http.post(f"/v1/queues/{queue}/purge", params=params))

    def wait(self, job_id: str, timeout_s: float | None = None, *, long_poll_s: float = LONG_POLL_S
             ) -> dict[str, Any]:
        """Long polls (`GET ?wait=`) until the job is in a final status; TimeoutError after `timeout_s`.
        A lost answer (dropped connection, 502/503/504) is asked again."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait_s = long_poll_s if deadline is None else min(long_poll_s, deadline - time.monotonic())
            asked = time.monotonic()
            job = self._retrying(functools.partial(self.get, job_id, wait_s))
            if job["status"] in TERMINAL:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} still {job['status']} after {timeout_s} s")
            if time.monotonic() - asked < wait_s / 2:  # an API without long poll answers at once: no spinning
                time.sleep(EARLY_ANSWER_PAUSE_S)

    @staticmethod
    def _retrying(call: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        retrying = Retrying(retry=retry_if_exception(_worth_retrying), stop=stop_after_attempt(TRIES),
                            wait=wait_exponential(multiplier=0.2, max=2.0), reraise=True)
        for attempt in retrying:
            with attempt:
                return call()
        raise AssertionError("unreachable: Retrying either returns or raises")

    @staticmethod
    def _json(response: httpx.Response) -> dict[str, Any]:
        body: dict[str, Any] = response.json() if response.content else {}
        if response.status_code >= 400:
            raise ClientError(response.status_code, body)
        return body


def new_idempotency_key() -> str:
    return "conveyor-cli-" + uuid.uuid4().hex


def _worth_retrying(exc: BaseException) -> bool:
    if isinstance(exc, ClientError):
        return exc.status in RETRIED_STATUSES
    return isinstance(exc, httpx.TransportError)
