"""Failure isolation: a step's forward or sampling that raises is retried in halves until each failure is
down to a single request; the parts that succeed keep their results.

The engine aborts only the requests that failed alone (StepError, in LLMEngine.last_failures); a broken
device fails them all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from conveyor.engine.sampler import SamplerOutput
from conveyor.engine.scheduled_chunk import ChunkPromptLogprobs, RunnerOutput, ScheduledChunk
from conveyor.engine.scheduler import SchedulerOutput
from conveyor.engine.sequence import Sequence
from conveyor.engine.speculation.draft_row import SamplingRow, owner

T = TypeVar("T")
X = TypeVar("X")
Failures = dict[Sequence, Exception]  # requests that failed alone, with what they raised
PromptLogprobs = dict[Sequence, ChunkPromptLogprobs]  # the prompt logprobs each sequence's chunk computed
Execute = Callable[[list[ScheduledChunk]], RunnerOutput]  # chunks -> their logits and prompt logprobs
Sample = Callable[[torch.Tensor, list[SamplingRow]], SamplerOutput]  # (logits [B, V], B rows) -> B tokens


class StepError(RuntimeError):
    """A step failed for these requests even run alone; they were aborted (blocks freed). Cause in __cause__.

    LLMEngine.step() does not raise it: it lists one per failed request in `last_failures` and returns the
    request's final output (finish_reason "abort") with the others.
    """

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"engine step failed for {len(request_ids)} request(s): {cause!r}")
        self.request_ids = request_ids


def forward_isolated(
    execute: Execute, sched: SchedulerOutput, vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, list[Sequence], PromptLogprobs, Failures]:
    """Logits [len(seqs), V] of the sampling sequences that survive, those sequences, the prompt logprobs of
    the chunks that survive, and the failures."""
    out = attempt(execute, sched.chunks)
    if isinstance(out, Exception):
        return _isolate_forward(execute, sched, out, torch.empty(0, vocab_size, device=device))
    return out.logits, sched.sampling_seqs(), _by_sequence(sched.seqs, out.prompt_logprobs), {}


def sample_isolated(
    sample: Sample, logits: torch.Tensor, seqs: list[SamplingRow]
) -> tuple[SamplerOutput, list[SamplingRow], Failures]:
    """One token per surviving row (a sequence, or a speculating sequence's row), those rows, and the
    sequences whose rows failed."""
    sampled = attempt(lambda s: sample(logits, s), seqs)
    if isinstance(sampled, Exception):
        return _isolate_sampling(sample, logits, seqs, sampled)
    return sampled, seqs, {}


def _isolate_forward(
    execute: Execute, sched: SchedulerOutput, exc: Exception, no_logits: torch.Tensor
) -> tuple[torch.Tensor, list[Sequence], PromptLogprobs, Failures]:
    """Re-runs the failed forward in halves, down to single chunks, keeping every part that succeeds.

    Re-running a chunk is idempotent: schedule() already allocated its slots and advanced
    num_computed_tokens, the chunk writes its K/V into the same slots again (each layer writes before it
    attends), and attention reads only slots written by earlier steps or by the chunk itself, so nothing
    reads what a failed attempt left behind.
    """
    chunks, seqs = sched.chunks, sched.seqs
    parts, failed = isolate_failures(
        lambda idx: execute([chunks[i] for i in idx]), list(range(len(chunks))), exc
    )
    kept = [seqs[i] for idx, _ in parts for i in idx if chunks[i].sample]
    # Each part's rows are its sampling chunks in order, and parts come in chunk order.
    rows = [out.logits for _, out in parts]
    logits = torch.cat(rows) if rows else no_logits  # [0, V]
    prompt_logprobs: PromptLogprobs = {}
    for idx, out in parts:
        prompt_logprobs |= _by_sequence([seqs[i] for i in idx], out.prompt_logprobs)
    return logits, kept, prompt_logprobs, {seqs[i]: e for i, e in failed.items()}


def _by_sequence(seqs: list[Sequence], per_chunk: list[ChunkPromptLogprobs | None]) -> PromptLogprobs:
    """seqs[i] owns the chunk whose prompt logprobs are per_chunk[i]; those with none are left out."""
    return {seq: lp for seq, lp in zip(seqs, per_chunk, strict=True) if lp is not None}


def _isolate_sampling(
    sample: Sample, logits: torch.Tensor, seqs: list[SamplingRow], exc: Exception
) -> tuple[SamplerOutput, list[SamplingRow], Failures]:
    """Samples the failed batch again in halves, down to single rows, keeping every part that succeeds.

    A row's token does not depend on the other rows (a seeded row draws its own noise, shaped [V]), so
    greedy and seeded survivors get the tokens the whole batch would have given them; unseeded rows draw
    fresh noise, as in any batch. NOTE: a seeded row keeps its noise only if the failed attempts raised
    before the draw, as every per-request failure that validation lets through does (after the draw
    only the logprobs top-n remains, bounded by the vocabulary in make_sequence).
    """
    def sample_rows(rows: list[int]) -> SamplerOutput:
        return sample(logits[rows], [seqs[r] for r in rows])

    parts, failed = isolate_failures(sample_rows, list(range(len(seqs))), exc)
    kept = [seqs[r] for rows, _ in parts for r in rows]
    tokens = [t for _, out in parts for t in out.token_ids]
    logprobs = [lp for _, out in parts for lp in out.logprobs]
    return SamplerOutput(tokens, logprobs), kept, {owner(seqs[r]): e for r, e in failed.items()}


def isolate_failures(
    run: Callable[[list[int]], T], items: list[int], error: Exception
) -> tuple[list[tuple[list[int], T]], dict[int, Exception]]:
    """`run(items)` raised `error`: runs each half again, recursively, until every failure is one item.

    Returns the calls that succeeded as (items, result), in item order, and what each item raised alone.
    Retries: about 2 log2(n) per culprit; 2n - 2 when every item fails (a broken device fails them all).
    """
    if len(items) == 1:
        return [], {items[0]: error}
    parts: list[tuple[list[int], T]] = []
    failed: dict[int, Exception] = {}
    mid = len(items) // 2
    for half in (items[:mid], items[mid:]):
        result = attempt(run, half)
        if isinstance(result, Exception):
            half_parts, half_failed = isolate_failures(run, half, result)
            parts += half_parts
            failed |= half_failed
        else:
            parts.append((half, result))
    return parts, failed


def attempt(run: Callable[[list[X]], T], items: list[X]) -> T | Exception:
    """run(items), or what it raised: returned, not handled in an except block, so the retries' exceptions
    are not chained to (and do not keep alive) the one before."""
    try:
        return run(items)
    except Exception as exc:
        return exc


def advance_grammars(seqs: list[Sequence], runs: list[list[int]]) -> Failures:
    """Feeds each constrained request its sampled tokens; one the grammar rejects (the mask should make that
    impossible) fails that request alone."""
    failures: Failures = {}
    for seq, run in zip(seqs, runs, strict=True):
        matcher = seq.matcher
        rejected = next((t for t in run if matcher is not None and not matcher.accept_token(t)), None)
        if rejected is not None:
            failures[seq] = RuntimeError(f"the grammar rejected sampled token {rejected}")
    return failures
