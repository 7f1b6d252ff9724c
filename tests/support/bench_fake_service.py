"""A jobs API in memory for the HTTP bench's tests, served through httpx.MockTransport.

Each accepted job succeeds `service_s` after its submit. `honours_wait` picks a service with the long poll
(GET /v1/jobs/{id}?wait=S answers when the job is final or after S seconds) or an older one that ignores
`wait` and answers at once. `refuse(body)` may answer a submit with (status, JSON body or text, headers);
`broken_gets` job GETs fail first, as on a connection the server closed.
It records what the bench did: each job GET's query and time, submit times, and the most jobs open at once
(accepted, and not yet seen final by the client).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import httpx

Refusal = tuple[int, dict[str, Any] | str, dict[str, str]]


@dataclass
class FakeService:
    service_s: float = 0.01
    honours_wait: bool = True
    submit_s: float = 0.0  # how long a submit takes to answer
    refuse: Callable[[dict[str, Any]], Refusal | None] = lambda body: None
    broken_gets: int = 0  # this many job GETs first fail as a connection closed under them would
    created: dict[str, float] = field(default_factory=dict)
    submits: list[float] = field(default_factory=list)  # time.monotonic() of each submit
    gets: dict[str, list[tuple[float, dict[str, str]]]] = field(default_factory=dict)  # job: (time, query)
    open: set[str] = field(default_factory=set)
    peak_open: int = 0

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "POST" and path == "/v1/jobs":
            return await self._submit(json.loads(request.content))
        if request.method == "GET" and path.startswith("/v1/jobs/"):
            return await self._get(path.removeprefix("/v1/jobs/"), dict(request.url.params))
        if path == "/v1/queues":
            return httpx.Response(200, json={"data": [{"name": "interactive", "queued": 0, "running": 0}]})
        return httpx.Response(404, json={"error": {"code": "not_found", "message": path, "field": None}})

    async def _submit(self, body: dict[str, Any]) -> httpx.Response:
        self.submits.append(time.monotonic())
        await asyncio.sleep(self.submit_s)
        refused = self.refuse(body)
        if refused is not None:
            status, content, headers = refused
            if isinstance(content, str):
                return httpx.Response(status, text=content, headers=headers)
            return httpx.Response(status, json=content, headers=headers)
        job_id = f"job-{len(self.created)}"
        self.created[job_id] = time.time()
        self.open.add(job_id)
        self.peak_open = max(self.peak_open, len(self.open))
        return httpx.Response(202, json=self._job(job_id))

    async def _get(self, job_id: str, query: dict[str, str]) -> httpx.Response:
        self.gets.setdefault(job_id, []).append((time.monotonic(), query))
        if self.broken_gets > 0:
            self.broken_gets -= 1
            raise httpx.ReadError("connection closed")
        if self.honours_wait and "wait" in query:
            left = self.created[job_id] + self.service_s - time.time()
            await asyncio.sleep(max(0.0, min(left, float(query["wait"]))))
        job = self._job(job_id)
        if job["status"] == "succeeded":
            self.open.discard(job_id)
        return httpx.Response(200, json=job)

    def _job(self, job_id: str) -> dict[str, Any]:
        created = self.created[job_id]
        finished = created + self.service_s
        done = time.time() >= finished
        return {
            "id": job_id,
            "status": "succeeded" if done else "running",
            "queue": "interactive",
            "usage": {"prompt_tokens": 8, "completion_tokens": 1 if done else 0},
            "error": None,
            "created_at": _iso(created),
            "started_at": _iso(created),
            "first_token_at": _iso(finished) if done else None,
            "finished_at": _iso(finished) if done else None,
            "preemptions": 0,
        }


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat()
