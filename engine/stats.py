"""Engine counters: the last step's shape and cumulative totals, counted the same way in every setup."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class StepStats:
    num_seqs: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    step_seconds: float = 0.0
    forward_seconds: float = 0.0


@dataclass
class EngineTotals:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    generated_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    failed_requests: int = 0
    forward_seconds: float = 0.0

    def add_step(self, step: StepStats) -> None:
        self.steps += 1
        self.prefill_tokens += step.prefill_tokens
        self.decode_tokens += step.decode_tokens
        self.forward_seconds += step.forward_seconds


def stats_dict(
    running: dict[str, int],
    waiting: dict[str, int],
    kv_blocks_used: int,
    kv_blocks_total: int,
    block_size: int,
    preemptions_total: int,
    last_step: StepStats,
    totals: EngineTotals,
) -> dict[str, object]:
    """The flat, JSON-friendly snapshot behind LLMEngine.stats()."""
    return {
        "running": dict(running),
        "waiting": dict(waiting),
        "num_running": sum(running.values()),
        "num_waiting": sum(waiting.values()),
        "kv_blocks_used": kv_blocks_used,
        "kv_blocks_total": kv_blocks_total,
        "kv_blocks_free": kv_blocks_total - kv_blocks_used,
        "kv_block_size": block_size,
        "kv_usage": kv_blocks_used / kv_blocks_total,
        "preemptions_total": preemptions_total,
        "last_step": asdict(last_step),
        "totals": asdict(totals),
    }
