"""The engine loop: validate and queue requests, then step: schedule -> forward -> sample -> stop checks.

A step that raises is retried in halves until each failure is down to a single request: only the requests
that fail alone are aborted (reported in `last_failures`); the others keep the step's results.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.grammar import GrammarCompiler, xgrammar_matcher
from engine.outputs import FinishReason, RequestMetrics, RequestOutput
from engine.sampler import Sampler, SamplerOutput
from engine.sampling_params import SamplingParams
from engine.scheduled_chunk import ScheduledChunk
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence
from engine.stats import EngineTotals, StepStats, stats_dict
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)

T = TypeVar("T")
X = TypeVar("X")
Failures = dict[Sequence, Exception]  # requests that failed alone, with what they raised


class Runner(Protocol):
    """What the engine needs from the model runner (engine.model_runner.ModelRunner, or a test double)."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    device: torch.device
    last_forward_seconds: float

    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor: ...  # [num sampling chunks, V] fp32


class StepError(RuntimeError):
    """A step failed for these requests even run alone; they were aborted (blocks freed). Cause in __cause__.

    LLMEngine.step() does not raise it: it lists one per failed request in `last_failures` and returns the
    request's final output (finish_reason "abort") with the others.
    """

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"engine step failed for {len(request_ids)} request(s): {cause!r}")
        self.request_ids = request_ids


class LLMEngine:
    def __init__(
        self, config: EngineConfig, *, runner: Runner | None = None, tokenizer: Tokenizer | None = None
    ) -> None:
        if runner is None:
            from engine.model_runner import ModelRunner  # heavy: loads the weights

            runner = ModelRunner(config)
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer if tokenizer is not None else Tokenizer(config.model)
        self.max_model_len = runner.max_model_len
        self.vocab_size = runner.vocab_size
        self.block_manager = BlockManager(
            runner.num_kv_blocks, runner.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len)
        self.sampler = Sampler(runner.device, config.seed)
        self.eos_token_ids = self.tokenizer.eos_token_ids
        self.default_class = config.request_classes[0].name
        self._arrivals = itertools.count()
        self._pending_outputs: list[RequestOutput] = []  # aborts between steps, reported by the next step
        self.last_step = StepStats()
        self.last_failures: list[StepError] = []  # requests the last step failed, until the next step
        self.totals = EngineTotals()
        self._grammars: GrammarCompiler | None = None  # built by the first constrained request
        self._grammars_lock = threading.Lock()

    # --- requests ------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_class: str | None = None,
        *,
        cache_salt: str | None = None,
    ) -> None:
        """Validates everything first (ValueError naming the field), so a bad request disturbs nothing."""
        self.enqueue(self.make_sequence(request_id, prompt, params, request_class, cache_salt=cache_salt))

    def make_sequence(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_class: str | None = None,
        *,
        cache_salt: str | None = None,
        attach_grammar: bool = True,
    ) -> Sequence:
        """Validates a request and builds its Sequence without touching engine state (thread-safe).

        A constrained request gets its grammar state here, compiled if need be; with attach_grammar False it
        has none yet, and the caller must `attach_grammar` before it enqueues it (EngineHost compiles on a
        thread of its own).

        NOTE: prompt + max_tokens must fit max_model_len (and the whole KV cache); we reject rather than
        silently shorten max_tokens, so a caller never gets a surprise "length" finish.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string or None, got {cache_salt!r}")
        params = params if params is not None else SamplingParams()
        params.validate()
        self._check_vocab_bounds(params)
        cls = self.config.request_class(request_class if request_class is not None else self.default_class)
        prompt_ids = self._prompt_token_ids(prompt)
        self._check_length(len(prompt_ids), params.max_tokens)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            request_class=cls.name,
            priority=cls.priority,
            arrival_order=-1,  # set by enqueue, in the engine's own order
            metrics=RequestMetrics(arrival_time=time.time()),
            generator=self.sampler.make_generator(params.seed) if params.seed is not None else None,
            prompt=prompt if isinstance(prompt, str) else None,
            cache_salt=cache_salt,
            detokenizer=IncrementalDetokenizer(self.tokenizer),
            logprobs=[] if params.logprobs is not None else None,
        )
        if attach_grammar:
            self.attach_grammar(seq, compile=True)
        return seq

    def attach_grammar(self, seq: Sequence, *, compile: bool) -> bool:
        """Gives a constrained seq its grammar state, from the cache or (when `compile`) compiling it.
        False when it still needs a compile. Raises ValueError (GrammarLimitError) for a constraint that
        cannot be compiled, or was refused before."""
        structured = seq.params.structured
        if structured is None:
            return True
        if not compile and self._grammars is None:
            return False  # the compiler (seconds for a large vocabulary) is built by the first compile
        compiler = self.grammar_compiler
        compiled = compiler.compile(structured) if compile else compiler.cached(structured)
        if compiled is None:
            return False
        seq.matcher = xgrammar_matcher(compiled)
        return True

    def enqueue(self, seq: Sequence) -> None:
        if self.scheduler.get(seq.request_id) is not None:
            raise ValueError(f"request_id {seq.request_id!r} is already running or waiting")
        seq.arrival_order = next(self._arrivals)
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        """Frees the request's blocks at once; its final output (finish_reason "abort") comes from step()."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        self.totals.aborted_requests += 1
        self._pending_outputs.append(_to_output(seq, num_new_tokens=0))
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending_outputs)

    # --- the step ------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one batch; returns an output for every request that got a token or finished (failed ones
        included, as "abort": their causes are in last_failures)."""
        start = time.perf_counter()
        self.last_failures = []
        outputs, self._pending_outputs = self._pending_outputs, []
        evictions_before = self.block_manager.num_evictions
        sched = self.scheduler.schedule()
        evictions = self.block_manager.num_evictions - evictions_before
        forward_seconds = 0.0
        if sched.chunks:
            outputs += self._run(sched)
            forward_seconds = self.runner.last_forward_seconds
        self._record_step(sched, time.perf_counter() - start, forward_seconds, evictions)
        return outputs

    def _run(self, sched: SchedulerOutput) -> list[RequestOutput]:
        logits, seqs, failures = self._forward(sched)
        self._cache_computed_blocks(sched, failures)
        sampled, seqs, sampling_failures = self._sample(logits, seqs)
        sampling_failures |= _advance_grammars(seqs, sampled.token_ids)
        now = time.time()
        outputs = []
        for seq, token, logprobs in zip(seqs, sampled.token_ids, sampled.logprobs, strict=True):
            if seq in sampling_failures:
                continue
            self._append_token(seq, token, logprobs, now)
            outputs.append(_to_output(seq, num_new_tokens=1))
        if failures or sampling_failures:
            outputs += self._fail(failures | sampling_failures)
        return outputs

    def _forward(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence], Failures]:
        """Logits [len(seqs), V] of the sampling sequences that survive, those sequences, and the failures."""
        logits = _attempt(self.runner.execute, sched.chunks)
        if isinstance(logits, Exception):
            return self._isolate_forward(sched, logits)
        return logits, sched.sampling_seqs(), {}

    def _isolate_forward(
        self, sched: SchedulerOutput, exc: Exception
    ) -> tuple[torch.Tensor, list[Sequence], Failures]:
        """Re-runs the failed forward in halves, down to single chunks, keeping every part that succeeds.

        Re-running a chunk is idempotent: schedule() already allocated its slots and advanced
        num_computed_tokens, the chunk writes its K/V into the same slots again (each layer writes before it
        attends), and attention reads only slots written by earlier steps or by the chunk itself, so nothing
        reads what a failed attempt left behind.
        """
        chunks, seqs = sched.chunks, sched.seqs
        parts, failed = _isolate_failures(
            lambda idx: self.runner.execute([chunks[i] for i in idx]), list(range(len(chunks))), exc
        )
        kept = [seqs[i] for idx, _ in parts for i in idx if chunks[i].sample]
        # Each part's rows are its sampling chunks in order, and parts come in chunk order.
        rows = [logits for _, logits in parts]
        logits = torch.cat(rows) if rows else torch.empty(0, self.vocab_size, device=self.runner.device)
        return logits, kept, {seqs[i]: e for i, e in failed.items()}

    def _cache_computed_blocks(self, sched: SchedulerOutput, failures: Failures) -> None:
        """Registers the full blocks the forward computed in the prefix cache, before any request finishes
        (and frees its blocks). A failed chunk's blocks may be half written: they are not registered."""
        for seq in sched.seqs:
            if seq not in failures:
                self.block_manager.cache_computed_blocks(seq)

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[SamplerOutput, list[Sequence], Failures]:
        """One token per surviving sequence, those sequences, and the failures."""
        sampled = _attempt(lambda s: self.sampler(logits, s, self.eos_token_ids), seqs)
        if isinstance(sampled, Exception):
            return self._isolate_sampling(logits, seqs, sampled)
        return sampled, seqs, {}

    def _isolate_sampling(
        self, logits: torch.Tensor, seqs: list[Sequence], exc: Exception
    ) -> tuple[SamplerOutput, list[Sequence], Failures]:
        """Samples the failed batch again in halves, down to single rows, keeping every part that succeeds.

        A row's token does not depend on the other rows (a seeded row draws its own noise, shaped [V]), so
        greedy and seeded survivors get the tokens the whole batch would have given them; unseeded rows draw
        fresh noise, as in any batch. NOTE: a seeded row keeps its noise only if the failed attempts raised
        before the draw, as every per-request failure that validation lets through does (after the draw
        only the logprobs top-n remains, bounded by the vocabulary in make_sequence).
        """
        def sample(rows: list[int]) -> SamplerOutput:
            return self.sampler(logits[rows], [seqs[r] for r in rows], self.eos_token_ids)

        parts, failed = _isolate_failures(sample, list(range(len(seqs))), exc)
        kept = [seqs[r] for rows, _ in parts for r in rows]
        tokens = [t for _, out in parts for t in out.token_ids]
        logprobs = [lp for _, out in parts for lp in out.logprobs]
        return SamplerOutput(tokens, logprobs), kept, {seqs[r]: e for r, e in failed.items()}

    def _fail(self, failures: Failures) -> list[RequestOutput]:
        """Aborts requests that failed alone; returns their final outputs and lists them in last_failures."""
        outputs = []
        for seq, cause in failures.items():
            log.error("request %s failed in an engine step; aborted", seq.request_id, exc_info=cause)
            self.scheduler.finish(seq, "abort")
            error = StepError([seq.request_id], cause)
            error.__cause__ = cause
            self.last_failures.append(error)
            outputs.append(_to_output(seq, num_new_tokens=0))
        self.totals.failed_requests += len(failures)
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None, now: float) -> None:
        seq.output_token_ids.append(token)
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append(logprobs)
        assert seq.detokenizer is not None
        delta = seq.detokenizer.step(seq.output_token_ids)
        seq.text += delta
        reason = self._stop_reason(seq, token, delta)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self.totals.finished_requests += 1
        self.totals.generated_tokens += 1

    def _stop_reason(self, seq: Sequence, token: int, delta: str) -> FinishReason | None:
        params = seq.params
        if seq.matcher is not None and seq.matcher.is_terminated():
            return "stop"  # the grammar is complete and its stop token (EOS) was sampled
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if token in params.stop_token_ids:
                return "stop"
            if delta and _truncate_at_stop_string(seq, len(delta)):
                return "stop"
        if seq.num_output_tokens >= params.max_tokens:
            return "length"
        return None

    # --- validation ----------------------------------------------------------------------------------

    def _check_vocab_bounds(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check without the model: the sampler's top-n needs n <= vocab size."""
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(
                f"logprobs must be at most the vocabulary size ({self.vocab_size}), got {params.logprobs}"
            )

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Built on first use (caller threads may race here), so unconstrained serving never loads it."""
        with self._grammars_lock:
            if self._grammars is None:
                config = self.config
                self._grammars = GrammarCompiler(
                    self.tokenizer.hf_tokenizer, self.vocab_size, sorted(self.eos_token_ids),
                    timeout_s=config.grammar_compile_timeout_s,
                    memory_bytes=config.grammar_compile_memory_bytes,
                    cache_bytes=config.grammar_cache_bytes,
                )
            return self._grammars

    def close(self) -> None:
        """Stops the grammar probe process, if one was started."""
        with self._grammars_lock:
            if self._grammars is not None:
                self._grammars.close()

    def _prompt_token_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list | tuple):
            ids = list(prompt)
            bad = [t for t in ids if not _is_token_id(t, self.vocab_size)]
            if bad:
                raise ValueError(f"prompt: token ids must be ints in [0, {self.vocab_size}), got {bad[:5]}")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt must not be empty")
        return ids

    def _check_length(self, num_prompt_tokens: int, max_tokens: int) -> None:
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt is {num_prompt_tokens} tokens; it must be shorter than max_model_len "
                f"({self.max_model_len}) to leave room for output"
            )
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens ({max_tokens}) + prompt ({num_prompt_tokens} tokens) must be <= max_model_len "
                f"({self.max_model_len})"
            )
        needed = self.block_manager.blocks_for_tokens(num_prompt_tokens + max_tokens)
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"max_tokens ({max_tokens}) + prompt ({num_prompt_tokens} tokens) need {needed} KV blocks; "
                f"the cache has {self.block_manager.num_blocks}"
            )

    # --- stats ---------------------------------------------------------------------------------------

    def _record_step(
        self, sched: SchedulerOutput, step_seconds: float, forward_seconds: float, evictions: int
    ) -> None:
        self.last_step = StepStats(
            num_seqs=len(sched.seqs),
            prefill_tokens=sched.num_prefill_tokens,
            decode_tokens=sched.num_decode_tokens,
            preemptions=len(sched.preempted),
            step_seconds=step_seconds,
            forward_seconds=forward_seconds,
            prefix_cache_queries=sched.num_lookup_tokens,
            prefix_cache_hits=sched.num_cached_tokens,
            prefix_cache_evictions=evictions,
        )
        self.totals.add_step(self.last_step)

    def reset_prefix_cache(self) -> int:
        """Forgets every cached block no request holds (e.g. between benchmark runs); returns how many."""
        return self.block_manager.reset_prefix_cache()

    def stats(self) -> dict[str, object]:
        names = list(self.scheduler.classes)
        cache = self.block_manager.prefix_cache
        return stats_dict(
            running={n: self.scheduler.num_running(n) for n in names},
            waiting={n: self.scheduler.num_waiting(n) for n in names},
            kv_blocks_used=self.block_manager.num_used_blocks,
            kv_blocks_total=self.block_manager.num_blocks,
            block_size=self.block_manager.block_size,
            preemptions_total=self.scheduler.num_preemptions,
            last_step=self.last_step,
            totals=self.totals,
            prefix_cache_blocks=cache.num_cached_blocks if cache is not None else None,
        )


def _isolate_failures(
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
        result = _attempt(run, half)
        if isinstance(result, Exception):
            half_parts, half_failed = _isolate_failures(run, half, result)
            parts += half_parts
            failed |= half_failed
        else:
            parts.append((half, result))
    return parts, failed


def _attempt(run: Callable[[list[X]], T], items: list[X]) -> T | Exception:
    """run(items), or what it raised: returned, not handled in an except block, so the retries' exceptions
    are not chained to (and do not keep alive) the one before."""
    try:
        return run(items)
    except Exception as exc:
        return exc


def _advance_grammars(seqs: list[Sequence], tokens: list[int]) -> Failures:
    """Feeds each constrained request its sampled token; one the grammar rejects (the mask should make that
    impossible) fails that request alone."""
    failures: Failures = {}
    for seq, token in zip(seqs, tokens, strict=True):
        if seq.matcher is not None and not seq.matcher.accept_token(token):
            failures[seq] = RuntimeError(f"the grammar rejected sampled token {token}")
    return failures


def _is_token_id(value: object, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def _truncate_at_stop_string(seq: Sequence, delta_len: int) -> bool:
    """Looks for a stop string ending in the newest text; cuts the text before it. True if found."""
    stops = seq.params.stop_strings
    if not stops:
        return False
    # Only a match that overlaps the new text can be new.
    start = max(0, len(seq.text) - delta_len - max(len(s) for s in stops) + 1)
    hits = [i for i in (seq.text.find(s, start) for s in stops) if i >= 0]
    if not hits:
        return False
    seq.text = seq.text[: min(hits)]
    return True


def _to_output(seq: Sequence, num_new_tokens: int) -> RequestOutput:
    return RequestOutput(
        request_id=seq.request_id,
        prompt_token_ids=seq.prompt_token_ids,
        token_ids=list(seq.output_token_ids),
        text=seq.text,
        finish_reason=seq.finish_reason,
        metrics=RequestMetrics(**vars(seq.metrics)),
        logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
        num_new_tokens=num_new_tokens,
        prompt=seq.prompt,
        num_cached_tokens=seq.num_cached_tokens or 0,
    )
