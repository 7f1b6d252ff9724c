"""The engine loop: queue validated requests, then step: schedule -> forward -> sample -> output processing.

Each stage of the data flow lives beside it: the runner seam (engine/runner.py), input processing
(engine/input_processor.py, engine/structured_output/manager.py), failure isolation (engine/step_isolation.py:
a step that raises is retried in halves, and only the requests that fail alone are aborted, reported in
`last_failures`) and output processing (engine/output_processor.py: tokens appended, stop checks by
engine/stop_rules.py, finished requests into RequestOutputs). Callers' LoRA adapters: engine/lora/served.py.

An embedding engine (task "embed": its runner pools, engine/pooling.py) runs the same loop without sampling
(engine/pooling_step.py): its requests (PoolingParams) are prompts whose chunks' pooling rows are combined on
their sequence, and each finishes ("stop", with its vector) in the step that computes its last input token,
freeing its blocks at once. An encoder's engine takes whole inputs per step and no prefix cache.
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from conveyor.engine.block_manager import BlockManager
from conveyor.engine.config import EngineConfig
from conveyor.engine.input_processor import InputProcessor
from conveyor.engine.lora.manager import LoRAManager
from conveyor.engine.lora.served import ServedLoRAs
from conveyor.engine.model_source import with_model_folder
from conveyor.engine.output_processor import OutputProcessor, add_prompt_logprobs
from conveyor.engine.outputs import RequestOutput, request_output
from conveyor.engine.pace import PaceMeter
from conveyor.engine.pooling import PoolingConfig
from conveyor.engine.pooling_params import PoolingParams
from conveyor.engine.pooling_step import embedding_vectors, forward_pooled, pool_rows
from conveyor.engine.runner import Runner, make_runner
from conveyor.engine.sampler import Sampler
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.scheduled_chunk import RunnerOutput, ScheduledChunk
from conveyor.engine.scheduler import Scheduler, SchedulerOutput
from conveyor.engine.sequence import Sequence, Urgency
from conveyor.engine.speculation.draft_row import draft_rows
from conveyor.engine.speculation.verification import (
    accepted_runs,
    generator_states,
    record_drafts,
    rewind_generator,
    settle,
)
from conveyor.engine.stats import EngineTotals, StepStats, stats_dict
from conveyor.engine.step_isolation import (
    Failures,
    StepError,
    advance_grammars,
    forward_isolated,
    sample_isolated,
)
from conveyor.engine.structured_output.manager import StructuredOutputManager
from conveyor.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from conveyor.engine.structured_output.grammar import GrammarCompiler

log = logging.getLogger(__name__)

__all__ = ["LLMEngine", "Runner", "StepError"]


class LLMEngine:
    def __init__(
        self, config: EngineConfig, *, runner: Runner | None = None, tokenizer: Tokenizer | None = None
    ) -> None:
        if runner is None:
            config = with_model_folder(config)  # a GGUF file, hub id or preset: its local folder
            runner = make_runner(config)  # heavy: loads the weights
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer if tokenizer is not None else Tokenizer(config.model, config.chat_template)
        # For an embedding engine: the longest input it embeds; for a generation engine: prompt + output.
        self.max_model_len = runner.max_model_len
        self.vocab_size = runner.vocab_size
        self.pooling: PoolingConfig | None = getattr(runner, "pooling", None)
        self.task = "embed" if self.pooling is not None else "generate"
        if self.task == "embed" and config.speculative is not None:
            raise ValueError("speculative: an embedding engine generates no tokens to draft; leave it None")
        self.embedding_size: int | None = getattr(runner, "embedding_size", None)  # None: generates text
        is_encoder = bool(getattr(runner, "is_encoder", False))
        # The window every layer of the model attends within (None: some layer attends globally): blocks
        # before a sequence's window are released as it runs.
        self.block_manager = BlockManager(
            runner.num_kv_blocks, runner.block_size,
            enable_prefix_caching=config.enable_prefix_caching and not is_encoder,
            sliding_window=getattr(runner, "kv_sliding_window", None),
        )
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len, chunked=not is_encoder)
        self.sampler = Sampler(runner.device, config.seed)
        self.eos_token_ids = self.tokenizer.eos_token_ids
        self.lora: LoRAManager | None = getattr(runner, "lora", None)  # None: LoRA off
        self._loras = ServedLoRAs(self.lora, self.scheduler.num_unfinished_with_lora)
        self.inputs = InputProcessor(
            config, self.tokenizer, self.block_manager, self.sampler, self.max_model_len, self.vocab_size,
            pooling=self.pooling, embedding_size=self.embedding_size, lora=self.lora,
        )
        self.structured_outputs = StructuredOutputManager(config, self.tokenizer, self.vocab_size)
        self._arrivals = itertools.count()
        self._pending_outputs: list[RequestOutput] = []  # aborts between steps, reported by the next step
        self.last_step = StepStats()
        self.last_failures: list[StepError] = []  # requests the last step failed, until the next step
        self.totals = EngineTotals()
        self.output_processor = OutputProcessor(self.scheduler, self.totals, self.eos_token_ids)
        self.pace_meter = PaceMeter()  # seconds per step and per prompt token: requests' slack

    # --- requests ------------------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | PoolingParams | None = None,
        request_class: str | None = None, *, cache_salt: str | None = None, urgency: Urgency | None = None,
        lora: str | None = None,
    ) -> None:
        """Validates everything first (ValueError naming the field), so a bad request disturbs nothing.
        `params`: SamplingParams for a generation engine, PoolingParams for an embedding one (None: the
        defaults of the engine's kind). `urgency`: its priority and deadline within its class (default:
        neither). `lora`: a loaded adapter's name (`add_lora`); None: the base model."""
        self.enqueue(self.make_sequence(request_id, prompt, params, request_class, cache_salt=cache_salt,
                                        urgency=urgency, lora=lora))

    def make_sequence(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | PoolingParams | None = None,
        request_class: str | None = None, *, cache_salt: str | None = None, attach_grammar: bool = True,
        urgency: Urgency | None = None, lora: str | None = None,
    ) -> Sequence:
        """Validates a request and builds its Sequence without touching engine state (thread-safe).

        A constrained request gets its grammar state here, compiled if need be; with attach_grammar False it
        has none yet, and the caller must `attach_grammar` before it enqueues it (EngineHost compiles on a
        thread of its own).
        """
        seq = self.inputs.make_sequence(request_id, prompt, params, request_class, cache_salt=cache_salt,
                                        urgency=urgency, lora=lora)
        if attach_grammar:
            self.attach_grammar(seq, compile=True)
        return seq

    def attach_grammar(self, seq: Sequence, *, compile: bool) -> bool:
        """See StructuredOutputManager.attach: False while seq still needs a compile."""
        if seq.pooling is not None:
            return True  # an embedding has no grammar
        return self.structured_outputs.attach(seq, compile=compile)

    def enqueue(self, seq: Sequence) -> None:
        if self.scheduler.get(seq.request_id) is not None:
            raise ValueError(f"request_id {seq.request_id!r} is already running or waiting")
        if seq.lora_key is not None and not self._loras.is_current(seq.lora_key):
            raise ValueError(f"lora {seq.lora!r} was removed after the request was made")
        seq.arrival_order = next(self._arrivals)
        seq.pace = self.pace_meter.pace
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        """Frees the request's blocks at once; its final output (finish_reason "abort") comes from step()."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        self.totals.aborted_requests += 1
        self._pending_outputs.append(request_output(seq, num_new_tokens=0))
        return True

    # --- LoRA adapters ---------------------------------------------------------------------------------

    def add_lora(self, name: str, path: str | Path) -> None:
        """Loads the PEFT adapter folder `path` as `name`, for requests that name it; ValueError when LoRA is
        off (max_loras 0), the name is taken, or the adapter does not fit the model (naming what)."""
        self._loras.add(name, path)

    def remove_lora(self, name: str) -> None:
        """Unloads `name`. Refused (ValueError) while requests that name it are waiting or running: they
        finish (or are aborted) first; the adapter stays served until then."""
        self._loras.remove(name)

    def list_loras(self) -> list[str]:
        return self._loras.names()

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
        expert_tokens = self.runner.take_expert_load() if hasattr(self.runner, "take_expert_load") else []
        self.last_step = StepStats.of_step(sched, time.perf_counter() - start, forward_seconds, evictions,
                                           expert_tokens)
        self.totals.add_step(self.last_step)
        self.pace_meter.observe(self.last_step)
        if self.scheduler.speculator is not None and sched.chunks:
            self.scheduler.speculator.observe_step(sched.num_tokens, self.last_step.step_seconds)
        return outputs

    def _run(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """The step's outputs: the requests that ran, then those that failed alone (aborted)."""
        if self.pooling is not None:
            outputs, failures = self._embed(sched, self.pooling)
        else:
            outputs, failures = self._generate(sched)
        return outputs + self._fail(failures)

    def _generate(self, sched: SchedulerOutput) -> tuple[list[RequestOutput], Failures]:
        """forward -> prompt logprobs -> sample -> drafts verified -> grammars -> tokens appended, stop
        checks -> speculating requests settled on the tokens they kept."""
        logits, seqs, prompt_logprobs, failures = forward_isolated(
            self._execute, sched, self.vocab_size, self.runner.device
        )
        self._cache_computed_blocks(sched, failures)
        add_prompt_logprobs(prompt_logprobs)
        generators = generator_states(seqs)
        sampled, rows, sampling_failures = sample_isolated(
            lambda part_logits, part: self.sampler(part_logits, part, self.eos_token_ids), logits,
            draft_rows(seqs),
        )
        kept, runs, logprobs = accepted_runs(rows, sampled, set(sampling_failures))
        sampling_failures |= advance_grammars(kept, runs)
        if self.scheduler.speculator is not None:
            record_drafts(kept, runs, self.scheduler.speculator)
        outputs = self.output_processor.append_tokens(kept, runs, logprobs, sampling_failures)
        self._settle_drafts(kept, runs, generators, sampling_failures)
        outputs += self.output_processor.finish_scored_prompts(sched, failures)
        return outputs, failures | sampling_failures

    def _settle_drafts(self, seqs: list[Sequence], runs: list[list[int]],
                       generators: dict[Sequence, torch.Tensor], failures: Failures) -> None:
        """Speculating requests: seeded generators wound back to the rows kept, the state of those still
        running set back to the tokens they kept (engine/speculation/verification.py)."""
        for seq, run in zip(seqs, runs, strict=True):
            if not seq.draft_token_ids or seq in failures:
                continue
            if seq in generators:
                rewind_generator(seq, generators[seq], len(run), self.vocab_size, self.runner.device)
            settle(seq, self.block_manager)

    def _embed(self, sched: SchedulerOutput, pooling: PoolingConfig) -> tuple[list[RequestOutput], Failures]:
        """An embedding engine's step: each chunk's pooling row joins its sequence's, and the requests whose
        input is complete finish with their vectors."""
        rows, failures = forward_pooled(self.runner, sched, self.vocab_size)
        self._cache_computed_blocks(sched, failures)
        done = pool_rows(sched, rows, failures, pooling.method)
        vectors = embedding_vectors(done, pooling, self.embedding_size)
        return self.output_processor.finish_embedded(done, vectors), failures

    def _execute(self, chunks: list[ScheduledChunk]) -> RunnerOutput:
        """The runner's output; raises (so the chunks are retried, and a request failing alone is aborted)
        when a chunk's prompt logprobs are missing: its sequence's would have a gap."""
        out = self.runner.execute(chunks)
        if any(c.prompt_targets and lp is None for c, lp in zip(chunks, out.prompt_logprobs, strict=True)):
            raise RuntimeError("the model runner returned no prompt logprobs for a chunk that asked for them")
        return out

    def _cache_computed_blocks(self, sched: SchedulerOutput, failures: Failures) -> None:
        """Registers the full blocks the forward computed in the prefix cache, before any request finishes
        (and frees its blocks). A failed chunk's blocks may be half written: they are not registered.

        Then (sliding-window models) releases the blocks no later query reads: only once registered, so the
        prefix cache keeps them, and not a failed request's (it is aborted and frees all of them)."""
        for seq in sched.seqs:
            if seq not in failures:
                self.block_manager.cache_computed_blocks(seq)
                self.block_manager.free_outside_window(seq)

    def _fail(self, failures: Failures) -> list[RequestOutput]:
        """Aborts requests that failed alone; returns their final outputs and lists them in last_failures."""
        outputs = []
        for seq, cause in failures.items():
            log.error("request %s failed in an engine step; aborted", seq.request_id, exc_info=cause)
            self.scheduler.finish(seq, "abort")
            error = StepError([seq.request_id], cause)
            error.__cause__ = cause
            self.last_failures.append(error)
            outputs.append(request_output(seq, num_new_tokens=0))
        self.totals.failed_requests += len(failures)
        return outputs

    # --- grammars ------------------------------------------------------------------------------------

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Built on first use; ValueError naming the `structured` extra when xgrammar is not installed."""
        return self.structured_outputs.compiler

    @property
    def _grammars(self) -> GrammarCompiler | None:
        """The compiler once a compile built it (tests read its counters)."""
        return self.structured_outputs.built_compiler

    def close(self) -> None:
        """Stops the grammar probe process, if one was started."""
        self.structured_outputs.close()

    # --- stats ---------------------------------------------------------------------------------------

    def reset_prefix_cache(self) -> int:
        """Forgets every cached block no request holds (e.g. between benchmark runs); returns how many."""
        return self.block_manager.reset_prefix_cache()

    def stats(self) -> dict[str, object]:
        names = list(self.scheduler.classes)
        cache = self.block_manager.prefix_cache
        snapshot = stats_dict(
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
        speculator = self.scheduler.speculator
        return {**snapshot, "pace": self.pace_meter.pace.to_json(),
                "speculation": speculator.stats() if speculator is not None else None}

