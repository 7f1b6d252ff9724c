"""Continuous batching: which tokens of which requests run in the next step.

Unified token budget: a request is just prompt + output tokens, of which `num_computed_tokens` are in the
KV cache; prefill chunks and decode tokens are both "the next tokens to compute". Each step serves the
running requests first, then admits waiting ones while the token budget, `max_num_seqs` and each class's
`max_running` allow, both in one order: class priority, then each request's urgency (its priority, then its
deadline while that is ahead: engine/sequence.py Urgency), then arrival. The running set is sorted by it
at every step (a deadline passing moves a request back to its arrival's place), and the last of it is the
one preempted when blocks run out.

Prefix caching: a request admitted from the waiting queue first takes the longest chain of cached full
blocks that starts its tokens (conveyor.engine.prefix_cache); those tokens count as computed and spend none
of the step's budget. A preempted request frees its blocks into the cache and gets back, when readmitted,
whatever is still there. Blocks computed by a step are registered by LLMEngine once the step has succeeded. A
request that still collects prompt logprobs takes no hits (every prompt position must be computed to be
scored), but its computed blocks are registered for others all the same.

Speculation (EngineConfig.speculative): once every running request has its token or chunk, the requests
that decode get drafts after their last token (engine/speculation/speculator.py) from the budget left, in
the same order, before waiting requests are admitted. A draft takes only free blocks (nothing is preempted
for a guess) and is not counted as computed: the engine counts the accepted ones after verification and
releases the blocks of the rest (engine/speculation/verification.py).

Pooling requests (embeddings) are prompts that generate nothing: scheduled like any prefill, finished by
LLMEngine once their input is computed. One whose pooling reads every position (mean, cls) takes no hits,
like a request collecting prompt logprobs. An encoder's requests cannot be chunked (`chunked=False`): each
runs its whole input in one step or waits, and the step's budget is at least max_model_len so any request
fits an empty step.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace

from conveyor.engine.block_manager import BlockManager
from conveyor.engine.config import EngineConfig
from conveyor.engine.outputs import FinishReason
from conveyor.engine.prefix_cache import block_hashes
from conveyor.engine.prompt_logprobs import chunk_prompt_targets, reset_prompt_logprobs
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.scheduled_chunk import ScheduledChunk
from conveyor.engine.sequence import Sequence, SequenceStatus
from conveyor.engine.speculation.config import SpeculativeConfig
from conveyor.engine.speculation.speculator import Speculator
from conveyor.engine.waiting_queue import WaitingQueue


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    seqs: list[Sequence] = field(default_factory=list)  # seqs[i] owns chunks[i]
    preempted: list[Sequence] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_draft_tokens: int = 0  # speculation: drafts after decode tokens, verified by this step
    # Prefix cache lookups of the requests admitted this step: tokens looked up, and found cached.
    num_lookup_tokens: int = 0
    num_cached_tokens: int = 0
    # Hashes of the full blocks this step's chunks complete (prefix caching only).
    completed_block_hashes: set[bytes] = field(default_factory=set)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens + self.num_draft_tokens

    def sampling_seqs(self) -> list[Sequence]:
        """The sequences that get logits this step, in chunk order (the runner's logits rows)."""
        return [seq for seq, chunk in zip(self.seqs, self.chunks, strict=True) if chunk.sample]


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int, *,
                 chunked: bool = True) -> None:
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.chunked = chunked  # False: a request's whole input runs in one step (an encoder's)
        self.max_loras = config.max_loras  # distinct LoRA adapters among the running requests, at most
        self.max_num_batched_tokens = (
            config.max_num_batched_tokens if chunked else max(config.max_num_batched_tokens, max_model_len))
        self.long_prefill_token_threshold = config.long_prefill_token_threshold if chunked else 0
        self.classes = {c.name: c for c in config.request_classes}
        self.waiting: dict[str, WaitingQueue] = {name: WaitingQueue() for name in self.classes}
        self.running: list[Sequence] = []  # sorted by order_key at each step: the last is preempted first
        self.num_preemptions = 0
        self._running_per_class: Counter[str] = Counter()
        self._unfinished: dict[str, Sequence] = {}
        spec = config.speculative
        assert spec is None or isinstance(spec, SpeculativeConfig), spec  # EngineConfig parsed it
        self.speculator = Speculator(spec) if spec is not None and chunked else None

    # --- requests in and out -------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        assert seq.request_id not in self._unfinished, f"duplicate request id {seq.request_id}"
        assert seq.request_class in self.classes, f"unknown class {seq.request_class}"
        assert seq.max_total_tokens <= self.max_model_len
        self._unfinished[seq.request_id] = seq
        seq.status = SequenceStatus.WAITING
        self.waiting[seq.request_class].push(seq, time.time())

    def get(self, request_id: str) -> Sequence | None:
        return self._unfinished.get(request_id)

    def abort(self, request_id: str) -> Sequence | None:
        """Removes a waiting or running request and frees its blocks at once."""
        seq = self._unfinished.get(request_id)
        if seq is not None:
            self.finish(seq, "abort")
        return seq

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SequenceStatus.WAITING:
            assert not seq.block_table, "waiting requests hold no blocks"
            self.waiting[seq.request_class].remove(seq)
        else:
            assert seq.status is SequenceStatus.RUNNING, f"{seq.request_id} is {seq.status}"
            self._remove_running(seq)
            self.block_manager.free(seq)
        del self._unfinished[seq.request_id]
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.matcher = None  # releases the grammar state
        if self.speculator is not None:
            self.speculator.on_finish(seq)
        seq.metrics.finished_time = time.time()

    def has_unfinished(self) -> bool:
        return bool(self._unfinished)

    def num_unfinished_with_lora(self, name: str) -> int:
        return sum(1 for seq in self._unfinished.values() if seq.lora == name)

    def num_running(self, request_class: str) -> int:
        return self._running_per_class[request_class]

    def num_waiting(self, request_class: str) -> int:
        return len(self.waiting[request_class])

    # --- one step ------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        now = time.time()
        self.running.sort(key=lambda s: s.order_key(now))
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        # NOTE: after a preemption memory is short: no blocks for guesses, and no admissions (below).
        if self.speculator is not None and not out.preempted:
            budget = self._schedule_drafts(out, budget, self.speculator)
        # Admitting new work would only evict it again.
        if not out.preempted:
            self._schedule_waiting(out, budget, now)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._chunk_size(seq, budget)
            if n == 0:
                continue
            if self._reserve_or_preempt(seq, n, out):
                self._add_chunk(out, seq, n)
                budget -= n
        return budget

    def _reserve_or_preempt(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Finds blocks for n more tokens of seq, preempting the lowest running request until they fit.

        Requests are visited in priority order, so the victim is always one not yet scheduled this step
        (or seq itself, in which case seq is not scheduled).
        """
        while not self.block_manager.can_append(seq, n):
            victim = self.running[-1]
            assert victim not in out.seqs, "a scheduled request cannot be preempted"
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        self.block_manager.append_slots(seq, n)
        return True

    def _schedule_drafts(self, out: SchedulerOutput, budget: int, speculator: Speculator) -> int:
        """Adds drafts to the decode chunks, in order, while budget and free blocks last; returns the
        budget left."""
        decoding = [i for i, (seq, chunk) in enumerate(zip(out.seqs, out.chunks, strict=True))
                    if _is_decode(seq, chunk)]
        if not decoding or budget <= 0:
            return budget
        seqs = [out.seqs[i] for i in decoding]
        proposals = speculator.propose(seqs, [self._draft_limit(seq) for seq in seqs], out.num_tokens)
        for i, seq, drafts in zip(decoding, seqs, proposals, strict=True):
            drafts = drafts[:budget]
            if not drafts or not self.block_manager.can_append(seq, len(drafts)):
                continue
            assert not seq.draft_token_ids, f"{seq.request_id} has unverified drafts"
            self.block_manager.append_slots(seq, len(drafts))
            chunk = out.chunks[i]
            out.chunks[i] = replace(chunk, token_ids=chunk.token_ids + drafts,
                                    block_table=list(seq.block_table), num_draft_tokens=len(drafts))
            seq.draft_token_ids = drafts
            out.num_draft_tokens += len(drafts)
            budget -= len(drafts)
        return budget

    def _draft_limit(self, seq: Sequence) -> int:
        """The most drafts seq can use: output it may still generate after this step's token, room in the
        context, and a chunk within long_prefill_token_threshold (which sizes a sliding window's blocks)."""
        limit = min(seq.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens)
        if self.long_prefill_token_threshold > 0:
            limit = min(limit, self.long_prefill_token_threshold - 1)
        return limit

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        bm = self.block_manager
        while budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self._next_admissible(now)
            if seq is None:
                return
            uses_cache = seq.takes_cache_hits
            cached = bm.cached_prefix(seq) if uses_cache else []
            # NOTE: strict priority: lower requests do not jump a head that waits or does not fit.
            if uses_cache and bm.next_block_hash(seq, len(cached)) in out.completed_block_hashes:
                return  # this step computes its next block for another request: reuse it next step instead
            num_cached_tokens = len(cached) * bm.block_size
            n = self._chunk_size(seq, budget, num_cached_tokens)
            if n == 0 or not bm.can_allocate(n, cached):
                return
            self.waiting[seq.request_class].remove(seq)
            bm.allocate(seq, n, cached)
            seq.num_computed_tokens = num_cached_tokens
            self._count_lookup(out, seq, num_cached_tokens, uses_cache)
            self._admit(seq)
            self._add_chunk(out, seq, n)
            budget -= n

    def _count_lookup(self, out: SchedulerOutput, seq: Sequence, num_cached_tokens: int, looked_up: bool
                      ) -> None:
        if self.block_manager.prefix_cache is None:
            return
        if looked_up:
            out.num_lookup_tokens += seq.num_tokens
            out.num_cached_tokens += num_cached_tokens
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = num_cached_tokens

    def _next_admissible(self, now: float) -> Sequence | None:
        """The first waiting request, in order, of a class under its max_running, and whose LoRA adapter can
        run: one a running request already uses, or any while fewer than max_loras are in use. A request
        whose adapter must wait for a slot does not hold back those behind it that can run."""
        adapters = self._running_adapters()
        room = len(adapters) < self.max_loras

        def can_run(seq: Sequence) -> bool:
            return seq.lora_key is None or room or seq.lora_key in adapters

        heads = [
            queue.first_where(now, can_run) for name, queue in self.waiting.items()
            if queue and self._running_per_class[name] < self.classes[name].max_running
        ]
        return min((s for s in heads if s is not None), key=lambda s: s.order_key(now), default=None)

    def _running_adapters(self) -> set[str]:
        return {seq.lora_key for seq in self.running if seq.lora_key is not None}

    def _chunk_size(self, seq: Sequence, budget: int, num_computed_tokens: int | None = None) -> int:
        """Tokens of seq to compute this step, after num_computed_tokens (default: its own count)."""
        start = seq.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        n = min(seq.num_tokens - start, budget)
        if not self.chunked and n < seq.num_tokens - start:
            return 0  # all or nothing: it waits for a step with room for its whole input
        if self.long_prefill_token_threshold > 0:
            n = min(n, self.long_prefill_token_threshold)
        assert start + n <= self.max_model_len, (seq.request_id, start, n)
        return n

    def _add_chunk(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        start = seq.num_computed_tokens
        end = start + n
        targets = chunk_prompt_targets(seq, start, end)
        chunk = ScheduledChunk(
            token_ids=seq.token_slice(start, end),
            start_pos=start,
            block_table=list(seq.block_table),
            sample=end == seq.num_tokens and seq.max_tokens > 0,  # 0: the prompt is only scored or pooled
            prompt_logprobs=seq.params.prompt_logprobs if targets else None,  # targets: SamplingParams
            prompt_targets=targets,
            lora=seq.lora_key,
        )
        is_decode = n == 1 and seq.num_output_tokens > 0 and end == seq.num_tokens
        if is_decode:
            out.num_decode_tokens += 1
        else:
            out.num_prefill_tokens += n
        # NOTE: counted as computed when scheduled; a failed step re-runs these chunks (LLMEngine isolates
        # the failure), and writing a chunk's K/V again into the same slots is idempotent.
        seq.num_computed_tokens = end
        if self.block_manager.prefix_cache is not None:
            bs = self.block_manager.block_size
            out.completed_block_hashes.update(block_hashes(seq, bs, end // bs)[start // bs :])
        out.chunks.append(chunk)
        out.seqs.append(seq)

    # --- running set ---------------------------------------------------------------------------------

    def _admit(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = time.time()
        self._add_running(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: its generated tokens join the tokens to recompute, so output is unchanged.

        Its computed full blocks stay in the prefix cache (when on) until evicted: readmitted, it takes back
        whatever is still there and recomputes only the rest."""
        self._remove_running(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        reset_prompt_logprobs(seq)
        seq.pooled = None  # pooling starts again with the recomputed input
        seq.status = SequenceStatus.WAITING
        self.waiting[seq.request_class].push(seq, time.time())  # its arrival order keeps its place
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1

    def _add_running(self, seq: Sequence) -> None:
        self.running.append(seq)  # admitted in order, after every running request of this step
        self._running_per_class[seq.request_class] += 1

    def _remove_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._running_per_class[seq.request_class] -= 1


def _is_decode(seq: Sequence, chunk: ScheduledChunk) -> bool:
    """The chunk is the sequence's one newest token, and the sequence generates (it can be drafted for)."""
    return (chunk.sample and len(chunk.token_ids) == 1 and seq.num_output_tokens > 0
            and isinstance(seq.params, SamplingParams))
