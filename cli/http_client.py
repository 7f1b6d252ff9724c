"""A small synchronous client for the Conveyor REST API (used by `conveyor submit|status|wait|cancel`)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

TERMINAL = frozenset({"succeeded", "failed", "cancelled", "expired"})
SUBMIT_TRIES = 4
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
        retrying = Retrying(retry=retry_if_exception(_worth_retrying), stop=stop_after_attempt(SUBMIT_TRIES),
                            wait=wait_exponential(multiplier=0.2, max=2.0), reraise=True)
        for attempt in retrying:
            with attempt:
                return self._json(self.http.post("/v1/jobs", json=body, headers=headers))
        raise AssertionError("unreachable: Retrying either returns or raises")

    def get(self, job_id: str) -> dict[str, Any]:
        return self._json(self.http.get(f"/v1/jobs/{job_id}"))

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._json(self.http.post(f"/v1/jobs/{job_id}/cancel"))

    def wait(self, job_id: str, poll_s: float = 0.5, timeout_s: float | None = None) -> dict[str, Any]:
        """Polls until the job is in a final status; TimeoutError after `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            job = self.get(job_id)
            if job["status"] in TERMINAL:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['status']} after {timeout_s} s")
            time.sleep(poll_s)

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
