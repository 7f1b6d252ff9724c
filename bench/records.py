"""What a target hands back from one run: a record per request and a sample per engine step (or poll).

Both targets fill the same records, so one counting rule (bench/metrics.py) serves every
configuration. Times are wall-clock seconds (time.time()).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Status = Literal["completed", "cancelled", "failed"]


@dataclass
class RequestRecord:
    request_id: str
    group: str
    arrival_time: float  # when the client sent it: run start + the workload's arrival offset
    max_tokens: int
    prompt_tokens: int = 0
    output_tokens: int = 0
    status: Status = "failed"
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    cancel_requested: bool = False
    error: str | None = None  # why it failed; for a refusal at submit, the API's message
    # Over HTTP: the submit as the client saw it (POST /v1/jobs), and the error code of a refusal or failure.
    submit_time: float | None = None  # when the POST was sent
    submit_latency_s: float | None = None  # until its answer came back
    submit_status: int | None = None  # the answer's HTTP status; >= 400 is a refusal
    error_code: str | None = None
    constrained: bool = False  # its output was constrained to the bench's JSON Schema (--structured-share)
    # Speculative decoding (in-process engine): the tokens proposed for it and how many of them were
    # accepted, as its last output counted them; 0 with speculation off and for targets that cannot tell.
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # The request's own deadline (seconds after its arrival) and priority, as the workload gave them (an
    # exported trace's jobs); None: its group's. Deadline attainment uses its own when it has one.
    deadline_s: float | None = None
    priority: int | None = None

    @property
    def refused(self) -> bool:
        return self.submit_status is not None and self.submit_status >= 400

    @property
    def queue_time(self) -> float | None:
        return _since(self.first_scheduled_time, self.arrival_time)

    @property
    def ttft(self) -> float | None:
        return _since(self.first_token_time, self.arrival_time)

    @property
    def e2e(self) -> float | None:
        return _since(self.finished_time, self.arrival_time)

    @property
    def itl(self) -> float | None:
        """Mean inter-token latency: decode time spread over the tokens after the first."""
        if self.output_tokens < 2 or self.first_token_time is None or self.finished_time is None:
            return None
        return (self.finished_time - self.first_token_time) / (self.output_tokens - 1)


@dataclass
class StepSample:
    """The engine's state right after one step (offline) or one poll (HTTP: only counts, no KV)."""

    t: float  # seconds since the run started
    waiting: dict[str, int]
    running: dict[str, int]
    kv_used_blocks: int | None = None
    kv_total_blocks: int | None = None
    kv_block_size: int = 0
    kv_allocated_slots: dict[str, int] = field(default_factory=dict)  # per group: blocks x block_size
    kv_stored_tokens: dict[str, int] = field(default_factory=dict)  # per group: tokens in the cache
    num_tokens: int = 0  # tokens computed in this step
    num_seqs: int = 0  # sequences in this step's batch
    step_s: float = 0.0  # wall time of engine.step(), measured by the bench
    forward_s: float | None = None  # the model runner's forward time within the step


@dataclass
class RunResult:
    target: str  # "engine" | "http" | "hf-cb" | "hf-static"
    records: list[RequestRecord]
    samples: list[StepSample]
    start_time: float
    end_time: float
    preemptions_total: int = 0
    # The model's weights as the system holds them: bytes, and how ("fp32", "int4", "Q4_1 GGUF", ...).
    weights: tuple[int, str] | None = None
    notes: list[str] = field(default_factory=list)
    client_cpu_s: float | None = None  # HTTP: the bench's own CPU time (user + system) during the run
    # HTTP: the server's processes during the run: CPU per role (bench/server_cpu.py) and the pinning.
    server: dict[str, Any] | None = None
    # In-process engine: prefix cache tokens looked up / found and blocks evicted during the run (None: off).
    prefix_cache: dict[str, Any] | None = None
    # In-process engine on a mixture of experts: tokens routed to each expert during the run (all MoE
    # layers summed); None for a dense model.
    expert_tokens: list[int] | None = None
    # In-process engine with speculation on: its own totals during the run (bench/speculation.py
    # `speculation_delta`); None with speculation off or an engine that does not report it.
    speculation: dict[str, Any] | None = None

    @property
    def duration_s(self) -> float:
        return max(self.end_time - self.start_time, 1e-9)


def _since(t: float | None, t0: float) -> float | None:
    return None if t is None else max(0.0, t - t0)
