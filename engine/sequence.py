"""One request's state inside the engine: its tokens, how many are in the KV cache, and its blocks."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from conveyor.engine.outputs import FinishReason, RequestMetrics
from conveyor.engine.pace import Pace
from conveyor.engine.pooling_params import PoolingParams
from conveyor.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import xgrammar

    from conveyor.engine.speculation.speculator import DraftState
    from conveyor.engine.tokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


MAX_PRIORITY = 2**31 - 1  # a request's priority fits a signed 32-bit integer, as the service stores it


@dataclass(frozen=True)
class Urgency:
    """How urgent a request is within its class: `priority` first (lower first, vLLM's meaning), then, while
    its `deadline` (time.time() seconds) is ahead, its slack: the deadline minus the time it still needs
    (engine/pace.py), least first. A request without a deadline, or whose deadline has passed, orders by
    arrival after those racing theirs: a late request keeps its place, it does not jump everything."""

    priority: int = 0
    deadline: float | None = None

    def validate(self) -> None:
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) or not (
                -MAX_PRIORITY <= self.priority <= MAX_PRIORITY):
            raise ValueError(
                f"priority must be an int in [{-MAX_PRIORITY}, {MAX_PRIORITY}], got {self.priority!r}")
        deadline = self.deadline
        if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, int | float)
                                     or not math.isfinite(deadline)):
            raise ValueError(f"deadline must be a finite number of seconds or None, got {deadline!r}")

    def slack_key(self, now: float, needed_s: float) -> float:
        """The latest start that meets the deadline (deadline - needed_s) while the deadline is ahead, else
        infinity (ordered by arrival among the rest)."""
        if self.deadline is None or self.deadline <= now:
            return math.inf
        return self.deadline - needed_s


@dataclass(eq=False)
class Sequence:
    """Prefill and decode are the same thing here: tokens not yet in the KV cache get computed.

    A pooling request (params: PoolingParams) is prefill only: it generates nothing (max_tokens 0) and
    finishes once its last input token is computed, with the vector its hidden states pooled into.

    `block_table`, `block_hashes`, `num_registered_blocks` and `num_released_blocks` are read by everyone but
    changed only by the BlockManager (and conveyor.engine.prefix_cache.block_hashes).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    request_class: str
    priority: int  # of its class; lower = served first
    arrival_order: int  # engine-wide counter; kept across preemptions
    metrics: RequestMetrics
    urgency: Urgency = field(default_factory=Urgency)  # within its class
    # The engine's pace when the request was enqueued: its slack is judged by it, so its order key only grows
    # while it waits (engine/waiting_queue.py re-keys lazily).
    pace: Pace = field(default_factory=Pace)
    generator: torch.Generator | None = None  # only for seeded requests
    prompt: str | None = None
    # Seeds the prefix cache's hash chain (conveyor.engine.prefix_cache.salt_root): requests with different
    # salts never share cached blocks (the service gives each tenant its own, or its cache namespace's, so a
    # hit cannot reveal what another tenant asked). None: unsalted.
    cache_salt: str | None = None
    # The LoRA adapter it runs with (its name, and the key of its registration: engine/lora/manager.py); None:
    # the base model.
    lora: str | None = None
    lora_key: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Prefix caching: the chained hash of each full block of its tokens so far (computed lazily, kept across
    # preemptions), and how many blocks at the head of block_table are in the prefix cache (hits, or blocks
    # it computed and registered).
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    # Sliding-window models: how many blocks at the head of block_table were released because no later query
    # reads them (their entries are -1; BlockManager.free_outside_window).
    num_released_blocks: int = 0
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at its first admission
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    detokenizer: IncrementalDetokenizer | None = None
    text: str = ""  # generated text, cut before a matched stop string
    logprobs: list[dict[int, float]] | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token computed so far, starting [None] (the
    # first token has nothing before it); complete at num_prompt_tokens entries. None: not asked for.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Grammar state of a constrained request: it has accepted every output token. Recompute preemption keeps
    # output_token_ids (only the KV is recomputed, no token is sampled again), so the state stays valid
    # across preemptions. Dropped (released) when the request finishes.
    matcher: xgrammar.GrammarMatcher | None = None
    # Pooling requests: its chunks' pooled row so far [H] fp32 (engine/pooling.py accumulate); dropped on
    # preemption (recomputed). And whether the pooling reads hidden states the prefix cache does not keep
    # (mean: every position; cls: the first), so its whole input must be computed.
    pooled: torch.Tensor | None = None
    pools_every_token: bool = False
    # Speculation (engine/speculation/): its proposer (made at its first decode step, dropped when it
    # finishes), the drafts scheduled after its last token in the running step (verified and cleared by the
    # same step), and over its life the draft tokens proposed and those accepted.
    drafting: DraftState | None = None
    draft_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def pooling(self) -> PoolingParams | None:
        return self.params if isinstance(self.params, PoolingParams) else None

    @property
    def max_tokens(self) -> int:
        """Output tokens it may generate (0: the prompt is only scored, or embedded)."""
        return self.params.max_tokens if isinstance(self.params, SamplingParams) else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.max_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and not all are in: its prompt must be computed, not read from cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def takes_cache_hits(self) -> bool:
        """Its prompt may be read from the prefix cache: it scores no prompt token and pools no hidden state
        that the cache lacks."""
        return not self.needs_prompt_logprobs and not self.pools_every_token

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def order_key(self, now: float) -> tuple[int, int, float, int]:
        """Sort key at time `now`: smaller is served first and preempted last (class priority, then its
        urgency, then arrival)."""
        return (self.priority, self.urgency.priority, self.urgency.slack_key(now, self.needed_s),
                self.arrival_order)

    @property
    def needed_s(self) -> float:
        """Time it still needs at its pace: the prompt left to compute and up to max_tokens more output (an
        upper bound: it may stop sooner). Never grows as it runs, so its order key never shrinks."""
        prompt_left = max(self.num_prompt_tokens - self.num_computed_tokens, 0)
        return self.pace.remaining_s(prompt_left, self.max_tokens - self.num_output_tokens)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without concatenating the whole history."""
        n_prompt = self.num_prompt_tokens
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
