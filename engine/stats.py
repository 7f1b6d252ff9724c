"""Engine counters: the last step's shape and cumulative totals, counted the same way in every setup."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.engine.scheduler import SchedulerOutput


@dataclass
class StepStats:
    num_seqs: int = 0
    prefill_tokens: int = 0  # tokens computed, so cached ones are not in it
    decode_tokens: int = 0
    draft_tokens: int = 0  # speculation: drafts verified after decode tokens
    preemptions: int = 0
    step_seconds: float = 0.0
    forward_seconds: float = 0.0
    # Prefix cache, over the requests admitted this step (readmissions after preemption included): tokens
    # looked up, tokens found cached, and cached blocks evicted to make room.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_evictions: int = 0
    # MoE models: tokens routed to each expert this step, summed over the MoE layers (load balance); else [].
    expert_tokens: list[int] = field(default_factory=list)

    @classmethod
    def of_step(
        cls, sched: SchedulerOutput, step_seconds: float, forward_seconds: float, evictions: int,
        expert_tokens: list[int] | None = None,
    ) -> StepStats:
        return cls(
            num_seqs=len(sched.seqs),
            prefill_tokens=sched.num_prefill_tokens,
            decode_tokens=sched.num_decode_tokens,
            draft_tokens=sched.num_draft_tokens,
            preemptions=len(sched.preempted),
            step_seconds=step_seconds,
            forward_seconds=forward_seconds,
            prefix_cache_queries=sched.num_lookup_tokens,
            prefix_cache_hits=sched.num_cached_tokens,
            prefix_cache_evictions=evictions,
            expert_tokens=expert_tokens or [],
        )


@dataclass
class EngineTotals:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    generated_tokens: int = 0
    finished_requests: int = 0
    # Pooling requests finished with their vector (also in finished_requests). Their input tokens count as
    # prefill tokens, like any prompt's; they generate none.
    embedded_requests: int = 0
    aborted_requests: int = 0
    failed_requests: int = 0
    forward_seconds: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_evictions: int = 0
    expert_tokens: list[int] = field(default_factory=list)  # per expert, summed over steps and MoE layers

    def add_step(self, step: StepStats) -> None:
        self.steps += 1
        self.prefill_tokens += step.prefill_tokens
        self.decode_tokens += step.decode_tokens
        self.forward_seconds += step.forward_seconds
        self.prefix_cache_queries += step.prefix_cache_queries
        self.prefix_cache_hits += step.prefix_cache_hits
        self.prefix_cache_evictions += step.prefix_cache_evictions
        if step.expert_tokens:
            totals = self.expert_tokens or [0] * len(step.expert_tokens)
            self.expert_tokens = [a + b for a, b in zip(totals, step.expert_tokens, strict=True)]


def hit_rate(hits: int, queries: int) -> float | None:
    """Share of looked-up tokens found in the prefix cache; None when nothing was looked up."""
    return hits / queries if queries else None


def stats_dict(
    running: dict[str, int],
    waiting: dict[str, int],
    kv_blocks_used: int,
    kv_blocks_total: int,
    block_size: int,
    preemptions_total: int,
    last_step: StepStats,
    totals: EngineTotals,
    prefix_cache_blocks: int | None = None,
) -> dict[str, object]:
    """The flat, JSON-friendly snapshot behind LLMEngine.stats().

    `prefix_cache_blocks`: blocks holding cached content (held or evictable); None when prefix caching is off.
    """
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
        "prefix_cache": {
            "enabled": prefix_cache_blocks is not None,
            "cached_blocks": prefix_cache_blocks or 0,
            "hit_rate": hit_rate(totals.prefix_cache_hits, totals.prefix_cache_queries),
            "last_step_hit_rate": hit_rate(last_step.prefix_cache_hits, last_step.prefix_cache_queries),
            "queries_total": totals.prefix_cache_queries,
            "hits_total": totals.prefix_cache_hits,
            "evictions_total": totals.prefix_cache_evictions,
        },
        "last_step": asdict(last_step),
        "totals": asdict(totals),
    }
