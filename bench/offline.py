"""The in-process target: the bench drives LLMEngine.add_request / step itself.

Requests are injected at their arrival offsets on the wall clock (between steps: a request due during a
step is added right after it, and its latency still counts from its due time). After every step the bench
reads the scheduler and block manager directly, so running counts, KV usage and KV waste are exact.
Cancellation: a request with `cancel_after_tokens` is aborted once it has that many output tokens. A request
carries its priority and deadline (its own, else its group's) into the engine as the worker does a job's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from conveyor.bench.records import RequestRecord, RunResult, StepSample
from conveyor.bench.speculation import engine_totals, output_counts, speculation_delta
from conveyor.bench.structured import BENCH_SCHEMA
from conveyor.bench.workload import BenchRequest
from conveyor.engine.llm_engine import LLMEngine, StepError
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.sequence import Urgency
from conveyor.engine.structured_output.constraint import StructuredOutput

ProgressFn = Callable[[int], None]  # called with the number of requests that just ended


def bench_params(
    req: BenchRequest, respect_eos: bool = False, structured: StructuredOutput | None = None
) -> SamplingParams:
    """Greedy, EOS ignored by default: every request does exactly its max_tokens, in every system (a
    constrained one ends sooner when its grammar completes)."""
    return SamplingParams(
        max_tokens=req.max_tokens, temperature=0.0, ignore_eos=not respect_eos, structured=structured
    )


def run_engine(
    engine: LLMEngine,
    requests: list[BenchRequest],
    *,
    respect_eos: bool = False,
    timeout_s: float | None = None,
    progress: ProgressFn | None = None,
    constrained: frozenset[str] = frozenset(),
    deadlines_s: dict[str, float] | None = None,
) -> RunResult:
    """`constrained`: ids of the requests whose output is constrained to the bench's JSON Schema;
    `deadlines_s`: per group, the deadline each request carries into the engine (its arrival + it), which
    the engine orders by unless its scheduling is `arrival`."""
    run = _OfflineRun(engine, requests, respect_eos, progress, constrained, deadlines_s or {})
    return run.execute(timeout_s)


class _OfflineRun:
    def __init__(
        self,
        engine: LLMEngine,
        requests: list[BenchRequest],
        respect_eos: bool,
        progress: ProgressFn | None,
        constrained: frozenset[str],
        deadlines_s: dict[str, float],
    ) -> None:
        self.constrained = constrained
        self.deadlines_s = deadlines_s
        self.schema = StructuredOutput(json_schema=BENCH_SCHEMA) if constrained else None
        self.engine = engine
        self.pending = sorted(requests, key=lambda r: r.arrival_s)
        self.by_id = {r.request_id: r for r in requests}
        self.respect_eos = respect_eos
        self.progress = progress or (lambda n: None)
        self.records: dict[str, RequestRecord] = {}
        self.samples: list[StepSample] = []
        self.start = 0.0
        self.notes: list[str] = []

    def execute(self, timeout_s: float | None) -> RunResult:
        self.start = time.time()
        preemptions_before = self.engine.scheduler.num_preemptions
        cache_before = prefix_cache_counts(self.engine)
        experts_before = list(self.engine.totals.expert_tokens)
        speculation_before = engine_totals(self.engine)
        while self.pending or self.engine.has_unfinished_requests():
            if timeout_s is not None and time.time() - self.start > timeout_s:
                self._give_up(timeout_s)
                break
            self._inject_due()
            if not self.engine.has_unfinished_requests():
                time.sleep(max(0.0, self.start + self.pending[0].arrival_s - time.time()))
                continue
            self._step()
        end = max([r.finished_time or 0.0 for r in self.records.values()] + [self.start])
        return RunResult(
            target="engine",
            records=list(self.records.values()),
            samples=self.samples,
            start_time=self.start,
            end_time=end,
            preemptions_total=self.engine.scheduler.num_preemptions - preemptions_before,
            notes=self.notes,
            prefix_cache=prefix_cache_delta(cache_before, prefix_cache_counts(self.engine)),
            expert_tokens=expert_tokens_delta(experts_before, self.engine.totals.expert_tokens),
            speculation=speculation_delta(speculation_before, engine_totals(self.engine)),
        )

    def _inject_due(self) -> None:
        now = time.time() - self.start
        while self.pending and self.pending[0].arrival_s <= now:
            req = self.pending.pop(0)
            record = RequestRecord(
                request_id=req.request_id,
                group=req.group,
                arrival_time=self.start + req.arrival_s,
                max_tokens=req.max_tokens,
                cancel_requested=False,
                constrained=req.request_id in self.constrained,
                deadline_s=req.deadline_s,
                priority=req.priority,
            )
            self.records[req.request_id] = record
            prompt: str | list[int] = (
                req.prompt if req.prompt is not None else list(req.prompt_token_ids or [])
            )
            try:
                self.engine.add_request(
                    req.request_id,
                    prompt,
                    bench_params(req, self.respect_eos, self._structured(req)),
                    req.group,
                    urgency=self._urgency(req, record.arrival_time),
                )
            except ValueError as exc:
                record.error = f"rejected: {exc}"
                record.finished_time = time.time()
                self.progress(1)

    def _urgency(self, req: BenchRequest, arrival_time: float) -> Urgency:
        """The request's priority and deadline, as the worker gives a job's (worker/attempt.py): its own
        deadline, else its group's (none: ordered by class priority and arrival)."""
        deadline_s = req.deadline_s if req.deadline_s is not None else self.deadlines_s.get(req.group)
        deadline = None if deadline_s is None else arrival_time + deadline_s
        return Urgency(priority=req.priority or 0, deadline=deadline)

    def _structured(self, req: BenchRequest) -> StructuredOutput | None:
        return self.schema if req.request_id in self.constrained else None

    def _step(self) -> None:
        begin = time.perf_counter()
        outputs = self.engine.step()
        step_s = time.perf_counter() - begin
        for out in outputs:
            self._observe(out)  # a request the step failed ends here as "abort": counted failed
        for error in self.engine.last_failures:
            self._note_failure(error)
        self.samples.append(self._sample(step_s))

    def _observe(self, out: RequestOutput) -> None:
        record = self.records[out.request_id]
        req = self.by_id[out.request_id]
        record.prompt_tokens = len(out.prompt_token_ids)
        record.output_tokens = len(out.token_ids)
        m = out.metrics
        record.first_scheduled_time = m.first_scheduled_time
        record.first_token_time = m.first_token_time
        record.num_preemptions = m.num_preemptions
        record.drafted_tokens, record.accepted_tokens = output_counts(out)
        if out.finished:
            record.finished_time = m.finished_time or time.time()
            record.status = (
                "cancelled"
                if out.finish_reason == "abort" and record.cancel_requested
                else ("completed" if out.finish_reason in ("stop", "length") else "failed")
            )
            self.progress(1)
        elif req.cancel_after_tokens is not None and record.output_tokens >= req.cancel_after_tokens:
            record.cancel_requested = True
            self.engine.abort_request(out.request_id)  # its "abort" output arrives with the next step

    def _sample(self, step_s: float) -> StepSample:
        sched = self.engine.scheduler
        bm = self.engine.block_manager
        allocated: dict[str, int] = {}
        stored: dict[str, int] = {}
        for seq in sched.running:
            g = seq.request_class
            allocated[g] = allocated.get(g, 0) + len(seq.block_table) * bm.block_size
            stored[g] = stored.get(g, 0) + seq.num_computed_tokens
        last = self.engine.last_step
        return StepSample(
            t=time.time() - self.start,
            waiting={n: sched.num_waiting(n) for n in sched.classes},
            running={n: sched.num_running(n) for n in sched.classes},
            kv_used_blocks=bm.num_used_blocks,
            kv_total_blocks=bm.num_blocks,
            kv_block_size=bm.block_size,
            kv_allocated_slots=allocated,
            kv_stored_tokens=stored,
            num_tokens=last.prefill_tokens + last.decode_tokens,
            num_seqs=last.num_seqs,
            step_s=step_s,
            forward_s=last.forward_seconds,
        )

    def _note_failure(self, error: StepError) -> None:
        self.notes.append(f"step failed: {error}")
        for rid in error.request_ids:
            self.records[rid].error = str(error.__cause__ or error)

    def _give_up(self, timeout_s: float) -> None:
        self.notes.append(f"run timed out after {timeout_s} s; unfinished requests counted as failed")
        for req in self.pending:
            self.records[req.request_id] = RequestRecord(
                request_id=req.request_id,
                group=req.group,
                arrival_time=self.start + req.arrival_s,
                max_tokens=req.max_tokens,
                error="not submitted before the timeout",
                deadline_s=req.deadline_s,
                priority=req.priority,
            )
        for rid, record in self.records.items():
            if record.finished_time is None:
                self.engine.abort_request(rid)
                record.error = record.error or "unfinished at the timeout"
        self.pending.clear()
        while self.engine.has_unfinished_requests():
            self.engine.step()  # drains the abort outputs so the engine is clean for the next run


def warm_up(engine: LLMEngine, requests: list[BenchRequest]) -> None:
    """One small request through the engine so first-call costs don't land on the measured run; then the
    prefix cache forgets it, so the run starts cold whether or not it shares the warm-up's tokens."""
    ids = next((r.prompt_token_ids for r in requests if r.prompt_token_ids), None) or [1, 2, 3]
    engine.add_request(
        "bench-warmup", ids[:32], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    )
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()


def prefix_cache_counts(engine: LLMEngine) -> tuple[int, int, int] | None:
    """(tokens looked up, tokens found, blocks evicted) so far; None with prefix caching off."""
    if not engine.config.enable_prefix_caching:
        return None
    t = engine.totals
    return t.prefix_cache_queries, t.prefix_cache_hits, t.prefix_cache_evictions


def expert_tokens_delta(before: list[int], after: list[int]) -> list[int] | None:
    """Tokens per expert routed during the run; None for a dense model (no expert counts at all)."""
    if not after:
        return None
    before = before or [0] * len(after)
    return [a - b for a, b in zip(after, before, strict=True)]


def prefix_cache_delta(
    before: tuple[int, int, int] | None, after: tuple[int, int, int] | None
) -> dict[str, Any] | None:
    """The run's prefix cache figures: tokens looked up and found, hit rate, evictions."""
    if before is None or after is None:
        return None
    queries, hits, evictions = (a - b for a, b in zip(after, before, strict=True))
    return {
        "queried_tokens": queries,
        "hit_tokens": hits,
        "hit_rate": hits / queries if queries else None,
        "evictions": evictions,
    }


def engine_config_dict(engine: LLMEngine) -> dict[str, Any]:
    from dataclasses import asdict

    d = asdict(engine.config)
    d["resolved"] = {
        "num_kv_blocks": engine.block_manager.num_blocks,
        "block_size": engine.block_manager.block_size,
        "max_model_len": engine.max_model_len,
    }
    return d
