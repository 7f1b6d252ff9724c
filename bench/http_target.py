"""The service target: jobs submitted over HTTP (httpx only; nothing from api/ or worker/ is imported).

Each request is POSTed to /v1/jobs at its arrival offset on its group's queue, then polled at
GET /v1/jobs/{id} until it ends; a request with `cancel_after_tokens` is cancelled (POST
/v1/jobs/{id}/cancel) as soon as a poll sees it running — mid-flight. Latencies come from the job's own
timestamps (created, started, first token, finished), so polling delay does not blur them. A sampler polls
GET /v1/queues for queue depth and running jobs over time (the service does not expose KV usage per step).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import httpx

from bench.records import RequestRecord, RunResult, StepSample
from bench.workload import BenchRequest

TERMINAL = {"succeeded", "failed", "cancelled", "expired"}
ProgressFn = Callable[[int], None]


def run_http(
    base_url: str,
    requests: list[BenchRequest],
    *,
    api_key: str | None = None,
    decode: Callable[[list[int]], str] | None = None,
    respect_eos: bool = False,
    poll_s: float = 0.2,
    timeout_s: float = 600.0,
    progress: ProgressFn | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> RunResult:
    """`decode` turns synthesised prompt token ids into text (the jobs API takes text prompts)."""
    run = _HttpRun(base_url, api_key, decode, respect_eos, poll_s, progress, transport)
    return asyncio.run(run.execute(requests, timeout_s))


class _HttpRun:
    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        decode: Callable[[list[int]], str] | None,
        respect_eos: bool,
        poll_s: float,
        progress: ProgressFn | None,
        transport: httpx.AsyncBaseTransport | None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.decode = decode
        self.respect_eos = respect_eos
        self.poll_s = poll_s
        self.progress = progress or (lambda n: None)
        self.transport = transport
        self.samples: list[StepSample] = []
        self.start = 0.0
        self.notes: list[str] = []

    async def execute(self, requests: list[BenchRequest], timeout_s: float) -> RunResult:
        self.start = time.time()
        records = [
            RequestRecord(
                request_id=r.request_id,
                group=r.group,
                arrival_time=self.start + r.arrival_s,
                max_tokens=r.max_tokens,
            )
            for r in requests
        ]
        async with httpx.AsyncClient(
            base_url=self.base_url, headers=self.headers, timeout=30.0, transport=self.transport
        ) as client:
            sampler = asyncio.create_task(self._sample_queues(client))
            jobs = [
                asyncio.create_task(self._one(client, req, rec))
                for req, rec in zip(requests, records, strict=True)
            ]
            _, unfinished = await asyncio.wait(jobs, timeout=timeout_s)
            for task in unfinished:
                task.cancel()
            if unfinished:
                self.notes.append(
                    f"{len(unfinished)} job(s) unfinished after {timeout_s} s: counted as failed"
                )
            sampler.cancel()
        end = max([r.finished_time or 0.0 for r in records] + [self.start])
        return RunResult(
            target="http",
            records=records,
            samples=self.samples,
            start_time=self.start,
            end_time=end,
            preemptions_total=sum(r.num_preemptions for r in records),
            notes=self.notes,
        )

    async def _one(self, client: httpx.AsyncClient, req: BenchRequest, rec: RequestRecord) -> None:
        await asyncio.sleep(max(0.0, self.start + req.arrival_s - time.time()))
        try:
            job = await self._submit(client, req)
            if job is None:
                rec.error, rec.finished_time = "rejected at submit", time.time()
                return
            rec.arrival_time = _epoch(job.get("created_at")) or time.time()
            while job.get("status") not in TERMINAL:
                await asyncio.sleep(self.poll_s)
                job = await self._get(client, job["id"])
                if req.cancel_after_tokens is not None and not rec.cancel_requested and _in_flight(job):
                    rec.cancel_requested = True
                    await client.post(f"/v1/jobs/{job['id']}/cancel")
            _fill(rec, job)
        except httpx.HTTPError as exc:
            rec.status, rec.error, rec.finished_time = "failed", f"http error: {exc!r}", time.time()
        finally:
            self.progress(1)

    async def _submit(self, client: httpx.AsyncClient, req: BenchRequest) -> dict[str, Any] | None:
        prompt = req.prompt
        if prompt is None:
            if self.decode is None:
                raise ValueError(
                    "decode: the HTTP target needs a tokenizer to send synthesised prompts as text"
                )
            prompt = self.decode(list(req.prompt_token_ids or []))
        body = {
            "prompt": prompt,
            "queue": req.group,
            "max_tokens": req.max_tokens,
            "temperature": 0.0,
            "ignore_eos": not self.respect_eos,
            "metadata": {"bench_request_id": req.request_id},
        }
        resp = await client.post("/v1/jobs", json=body)
        if resp.status_code >= 400:
            self.notes.append(f"{req.request_id}: submit answered {resp.status_code}: {resp.text[:200]}")
            return None
        return dict(resp.json())

    async def _get(self, client: httpx.AsyncClient, job_id: str) -> dict[str, Any]:
        resp = await client.get(f"/v1/jobs/{job_id}")
        resp.raise_for_status()
        return dict(resp.json())

    async def _sample_queues(self, client: httpx.AsyncClient) -> None:
        while True:
            try:
                resp = await client.get("/v1/queues")
                if resp.status_code == 200:
                    self.samples.append(_queue_sample(resp.json(), time.time() - self.start))
            except httpx.HTTPError:
                pass
            await asyncio.sleep(max(self.poll_s, 0.25))


def _in_flight(job: dict[str, Any]) -> bool:
    return job.get("status") == "running"


def _fill(rec: RequestRecord, job: dict[str, Any]) -> None:
    status = job.get("status")
    usage = job.get("usage") or {}
    rec.prompt_tokens = int(usage.get("prompt_tokens") or job.get("prompt_tokens") or 0)
    rec.output_tokens = int(usage.get("completion_tokens") or job.get("completion_tokens") or 0)
    rec.first_scheduled_time = _epoch(job.get("started_at"))
    rec.first_token_time = _epoch(job.get("first_token_at"))
    rec.finished_time = _epoch(job.get("finished_at")) or time.time()
    rec.num_preemptions = int(job.get("preemptions") or 0)
    if status == "succeeded":
        rec.status = "completed"
    elif status == "cancelled" and rec.cancel_requested:
        rec.status = "cancelled"
    else:
        rec.status = "failed"
        error = job.get("error") or {}
        rec.error = (
            f"{status}: {error.get('code') if isinstance(error, dict) else error or job.get('error_code')}"
        )


def _queue_sample(body: Any, t: float) -> StepSample:
    """Reads `{"data": [{"name", "queued", "running"}, ...]}` (the service's QueueList) or a bare list."""
    queues = body.get("data", body) if isinstance(body, dict) else body
    items = queues.items() if isinstance(queues, dict) else ((q.get("name"), q) for q in queues)
    waiting, running = {}, {}
    for name, q in items:
        waiting[str(name)] = int(q.get("queued") or 0)
        running[str(name)] = int(q.get("running") or 0)
    return StepSample(t=t, waiting=waiting, running=running)


def _epoch(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    parsed = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)).timestamp()
