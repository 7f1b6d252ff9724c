"""A small synchronous client for the Conveyor REST API (used by `conveyor submit|status|wait|cancel`)."""

from __future__ import annotations

import time
from typing import Any

import httpx

TERMINAL = frozenset({"succeeded", "failed", "cancelled", "expired"})


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
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._json(self.http.post("/v1/jobs", json=body, headers=headers))

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
