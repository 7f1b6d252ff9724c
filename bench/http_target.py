"""The service target: jobs submitted over HTTP (httpx only; nothing from api/ or worker/ is imported).

The workload is sent in one of two ways:
- open loop (the default): each request is POSTed to /v1/jobs at its arrival offset, on its group's queue,
  whatever is still in flight;
- closed loop (`concurrency=N`): N slots, each submitting a job, waiting for it to end, then submitting the
  next; arrival offsets are ignored.

Each accepted job is then awaited with the long poll GET /v1/jobs/{id}?wait=S (the service answers as soon
as the job is final, or after S seconds with its current state); a service that ignores `wait` answers at
once, and is then asked again every `poll_s`. Requests go out on small pools of connections created for the
run (bench/http_lanes.py), bodies encoded beforehand; a request's own `priority` and `deadline_s` (an
exported trace's) go in its body, else the queue's defaults apply. A request with `cancel_after_tokens` is
instead polled without `wait` until a poll sees it running, then cancelled (POST /v1/jobs/{id}/cancel):
mid-flight. Latencies come from the job's own timestamps (created, started, first token, finished), so
waiting does not blur them; the submit itself is timed on the client. A refusal keeps its HTTP status, error
code and message. A sampler polls GET /v1/queues for queue depth and running jobs over time (the service
does not expose KV usage per step).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import httpx

from conveyor.bench.http_lanes import Lanes
from conveyor.bench.records import RequestRecord, RunResult, StepSample
from conveyor.bench.service import refusal_notes
from conveyor.bench.workload import BenchRequest

TERMINAL = {"succeeded", "failed", "cancelled", "expired"}
ProgressFn = Callable[[int], None]
JSON_HEADERS = {"Content-Type": "application/json"}
READ_MARGIN_S = 30.0  # a long poll's read timeout is its wait plus this
# Open loop: every job awaited holds a connection for its long poll, so only this many are awaited at once
# (the others are looked at when a place frees; their timestamps are the service's, so nothing is blurred),
# and as many connections again are left for submits, so a POST rarely queues behind the waits.
OPEN_LOOP_WAITERS = 64
OPEN_LOOP_LANES = 32
OPEN_LOOP_LANE_CONNECTIONS = 4  # x 32 lanes = 128 connections: 64 waits and 64 submits
SLOT_CONNECTIONS = 2  # a closed loop's slot sends one request at a time; one spare


def run_http(
    base_url: str,
    requests: list[BenchRequest],
    *,
    api_key: str | None = None,
    decode: Callable[[list[int]], str] | None = None,
    respect_eos: bool = False,
    poll_s: float = 0.2,
    wait_s: float = 30.0,
    concurrency: int | None = None,
    timeout_s: float = 600.0,
    progress: ProgressFn | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> RunResult:
    """`decode` turns synthesised prompt token ids into text (the jobs API takes text prompts); `wait_s` is
    the long poll's wait (0: plain polls every `poll_s`); `concurrency` runs a closed loop."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    # Prompts are decoded and bodies encoded before the clock starts: the bench shares the server's CPUs.
    jobs = [_Job(r, _body(r, decode, respect_eos), _record(r)) for r in requests]
    run = _HttpRun(poll_s, wait_s, concurrency or OPEN_LOOP_WAITERS, progress or (lambda n: None))

    async def go() -> RunResult:
        async with _lanes(base_url, api_key, concurrency, transport) as lanes:
            return await run.execute(lanes, jobs, concurrency, timeout_s)

    cpu = time.process_time()
    result = asyncio.run(go())
    result.client_cpu_s = time.process_time() - cpu  # what the bench took from a machine it may share
    return result


@dataclass
class _Job:
    req: BenchRequest
    body: bytes
    rec: RequestRecord


def _record(req: BenchRequest) -> RequestRecord:
    return RequestRecord(
        req.request_id,
        req.group,
        arrival_time=0.0,
        max_tokens=req.max_tokens,
        deadline_s=req.deadline_s,
        priority=req.priority,
    )


def _body(req: BenchRequest, decode: Callable[[list[int]], str] | None, respect_eos: bool) -> bytes:
    prompt = req.prompt
    if prompt is None:
        if decode is None:
            raise ValueError("decode: the HTTP target needs a tokenizer to send synthesised prompts as text")
        prompt = decode(list(req.prompt_token_ids or []))
    body = {
        "prompt": prompt,
        "queue": req.group,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "ignore_eos": not respect_eos,
        "metadata": {"bench_request_id": req.request_id},
    }
    # A request's own urgency, named as the jobs API names it; without it the queue's defaults apply.
    if req.priority is not None:
        body["priority"] = req.priority
    if req.deadline_s is not None:
        body["deadline_s"] = req.deadline_s
    if req.model is not None:
        body["model"] = req.model
    return json.dumps(body).encode()


def _lanes(
    base_url: str, api_key: str | None, concurrency: int | None, transport: httpx.AsyncBaseTransport | None
) -> Lanes:
    """The run's clients (bench/http_lanes.py), sized so that no request waits for a connection."""
    if concurrency:
        return Lanes(base_url, api_key, concurrency, SLOT_CONNECTIONS, transport)
    return Lanes(base_url, api_key, OPEN_LOOP_LANES, OPEN_LOOP_LANE_CONNECTIONS, transport)


class _HttpRun:
    def __init__(self, poll_s: float, wait_s: float, waiters: int, progress: ProgressFn) -> None:
        self.poll_s = poll_s
        self.wait_s = wait_s
        self.waiters = asyncio.Semaphore(waiters)  # jobs awaited at once
        self.progress = progress
        self.samples: list[StepSample] = []
        self.notes: list[str] = []
        self.start = 0.0

    async def execute(
        self, lanes: Lanes, jobs: list[_Job], concurrency: int | None, timeout_s: float
    ) -> RunResult:
        self.start = time.time()
        sampler = asyncio.create_task(self._sample_queues(lanes.sampler))
        tasks = self._closed_loop(lanes, jobs, concurrency) if concurrency else self._open_loop(lanes, jobs)
        done, unfinished = await asyncio.wait(tasks, timeout=timeout_s)
        for task in [*unfinished, sampler]:
            task.cancel()
        await asyncio.gather(*unfinished, sampler, return_exceptions=True)
        for task in done:
            task.result()  # a bug in the bench must not pass for a failed job
        records = [job.rec for job in jobs]
        left = _mark_unfinished(records, timeout_s)
        if left:
            self.notes.append(f"{left} job(s) unfinished after {timeout_s:g} s: counted as failed")
        self.notes.extend(refusal_notes(records))
        return RunResult(
            target="http",
            records=records,
            samples=self.samples,
            start_time=self.start,
            end_time=max([r.finished_time or 0.0 for r in records] + [self.start]),
            preemptions_total=sum(r.num_preemptions for r in records),
            notes=self.notes,
        )

    def _open_loop(self, lanes: Lanes, jobs: list[_Job]) -> list[asyncio.Task[None]]:
        return [asyncio.create_task(self._at_arrival(lanes.lane(i), job)) for i, job in enumerate(jobs)]

    async def _at_arrival(self, client: httpx.AsyncClient, job: _Job) -> None:
        await asyncio.sleep(max(0.0, self.start + job.req.arrival_s - time.time()))
        await self._serve(client, job)

    def _closed_loop(self, lanes: Lanes, jobs: list[_Job], concurrency: int) -> list[asyncio.Task[None]]:
        queue = iter(jobs)

        async def slot(client: httpx.AsyncClient) -> None:
            for job in queue:  # shared by the slots: each takes the next job when its own one ends
                await self._serve(client, job)

        return [asyncio.create_task(slot(lanes.lane(i))) for i in range(min(concurrency, len(jobs)))]

    async def _serve(self, client: httpx.AsyncClient, job: _Job) -> None:
        rec = job.rec
        try:
            answer = await self._submit(client, job)
            if answer is not None:
                async with self.waiters:
                    answer = await self._until_final(client, job.req, rec, answer)
                _fill(rec, answer)
        except httpx.HTTPError as exc:
            rec.status, rec.finished_time = "failed", time.time()
            rec.error_code, rec.error = type(exc).__name__, f"http error: {exc!r}"
        finally:
            self.progress(1)

    async def _submit(self, client: httpx.AsyncClient, job: _Job) -> dict[str, Any] | None:
        """The accepted job, or None when the API refused it (the record then says why)."""
        rec = job.rec
        rec.submit_time = rec.arrival_time = time.time()
        sent = time.perf_counter()
        resp = await client.post("/v1/jobs", content=job.body, headers=JSON_HEADERS)
        rec.submit_latency_s = time.perf_counter() - sent
        rec.submit_status = resp.status_code
        if resp.status_code >= 400:
            rec.error_code, rec.error = refusal(resp)
            rec.finished_time = time.time()
            return None
        answer = dict(resp.json())
        rec.arrival_time = _epoch(answer.get("created_at")) or rec.submit_time
        return answer

    async def _until_final(
        self, client: httpx.AsyncClient, req: BenchRequest, rec: RequestRecord, job: dict[str, Any]
    ) -> dict[str, Any]:
        while job.get("status") not in TERMINAL:
            # Cancelling mid-flight needs to see `running`, which a long poll (final states only) skips.
            watching = req.cancel_after_tokens is not None and not rec.cancel_requested
            job = await self._look(client, job["id"], 0.0 if watching else self.wait_s)
            if watching and _in_flight(job):
                rec.cancel_requested = True
                await client.post(f"/v1/jobs/{job['id']}/cancel")
        return job

    async def _look(self, client: httpx.AsyncClient, job_id: str, wait_s: float) -> dict[str, Any]:
        """The job after a long poll of up to `wait_s`. Looks are at least `poll_s` apart: a server that
        ignores `wait` answers at once, and is then polled at that interval rather than hammered."""
        asked = time.monotonic()
        params = {"wait": f"{wait_s:g}"} if wait_s > 0 else None
        url, timeout = f"/v1/jobs/{job_id}", wait_s + READ_MARGIN_S
        try:
            resp = await client.get(url, params=params, timeout=timeout)
        except httpx.TransportError:  # e.g. a connection closed under it; a GET is safe to send again, once
            resp = await client.get(url, params=params, timeout=timeout)
        resp.raise_for_status()
        job = dict(resp.json())
        if job.get("status") not in TERMINAL:
            await asyncio.sleep(max(0.0, self.poll_s - (time.monotonic() - asked)))
        return job

    async def _sample_queues(self, client: httpx.AsyncClient) -> None:
        while True:
            try:
                resp = await client.get("/v1/queues")
                if resp.status_code == 200:
                    self.samples.append(_queue_sample(resp.json(), time.time() - self.start))
            except httpx.HTTPError:
                pass
            await asyncio.sleep(max(self.poll_s, 0.25))


def refusal(resp: httpx.Response) -> tuple[str, str]:
    """(code, message) of an error answer: the API's `{"error": {"code", "message"}}`, else the status
    and the start of the body; a Retry-After (admission control) is added to the message."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("code"):
        code, message = str(error["code"]), str(error.get("message") or "")
    else:
        code, message = f"http_{resp.status_code}", resp.text[:200]
    retry_after = resp.headers.get("Retry-After")
    return code, f"{message} (Retry-After: {retry_after})" if retry_after else message


def _mark_unfinished(records: list[RequestRecord], timeout_s: float) -> int:
    left = [r for r in records if r.finished_time is None]
    for r in left:
        r.error = f"unfinished after {timeout_s:g} s"
    return len(left)


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
        error = job.get("error")
        code = error.get("code") if isinstance(error, dict) else error or job.get("error_code")
        message = error.get("message") if isinstance(error, dict) else None
        rec.error_code = str(code or status)
        rec.error = f"{status}: {rec.error_code}" + (f": {message}" if message else "")


def _queue_sample(body: Any, t: float) -> StepSample:
    """Reads `{"data": [{"name", "queued", "running"}, ...]}` (the service's QueueList) or a bare list; a
    queue name that several served models have is summed over them."""
    queues = body.get("data", body) if isinstance(body, dict) else body
    items = queues.items() if isinstance(queues, dict) else ((q.get("name"), q) for q in queues)
    waiting: dict[str, int] = {}
    running: dict[str, int] = {}
    for name, q in items:
        waiting[str(name)] = waiting.get(str(name), 0) + int(q.get("queued") or 0)
        running[str(name)] = running.get(str(name), 0) + int(q.get("running") or 0)
    return StepSample(t=t, waiting=waiting, running=running)


def _epoch(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    parsed = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)).timestamp()
