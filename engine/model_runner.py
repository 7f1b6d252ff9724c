"""The model runner: loads the model, owns the KV cache, runs one flattened forward per step.

A step is a list of ScheduledChunk (prefill chunks and decode tokens of different sequences). The runner
concatenates their tokens into one batch of T tokens, derives positions and cache slots with tensor ops,
runs the model once, and computes logits only at the last token of each chunk that samples, and at the
positions of the chunks that score their prompt (conveyor.engine.prompt_logprobs).

An embedding engine's runner (task "embed") computes no logits (its model has no LM head): it returns, per
chunk, the row that pooling needs of the chunk's hidden states (engine/pooling.py chunk_rows). Encoders
have their own runner (engine/encoder_runner.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from itertools import chain, repeat
from typing import Any

import torch

from conveyor.engine.attention import KVCache, attention_metas
from conveyor.engine.config import EngineConfig
from conveyor.engine.kv_cache import KVCacheLayout, allocate_kv_cache, cuda_kv_budget_bytes, plan_num_blocks
from conveyor.engine.loader import (
    LoadTimings,
    check_tokenizer_files,
    load_model,
    resolve_device,
    resolve_dtype,
)
from conveyor.engine.lora.batch import LoRABatch
from conveyor.engine.lora.manager import LoRAManager
from conveyor.engine.models.layer_config import uniform_window
from conveyor.engine.models.llama import LlamaForCausalLM
from conveyor.engine.pooling import PoolingConfig, chunk_rows, embedding_max_len, pooling_config
from conveyor.engine.prompt_logprobs import score_prompt_chunks
from conveyor.engine.quantization import weight_bytes
from conveyor.engine.scheduled_chunk import RunnerOutput, ScheduledChunk
from conveyor.kernels.metadata import AttentionMetadata
from conveyor.kernels.paged_attention import resolve_backend

logger = logging.getLogger("conveyor.engine")


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [N] int64: the token rows whose logits are returned
    seq_of_token: torch.Tensor  # [T] int64: the chunk each token belongs to


class ModelRunner:
    is_encoder = False  # engine/encoder_runner.py runs encoders

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        started = time.perf_counter()  # timed for the worker's cold-start report (LoadTimings)
        self.attention_backend = resolve_backend(config.attention_backend, self.device)
        attention_s = time.perf_counter() - started
        check_tokenizer_files(config.model)
        started = time.perf_counter()
        model, self.hf_config, self.task, self.quantization = load_model(
            config.model, self.device, self.dtype, self.attention_backend, config.task, config.quantization)
        if not isinstance(model, LlamaForCausalLM):
            raise ValueError(f"model: {config.model} is an encoder; LLMEngine runs it with an EncoderRunner")
        self.model = model
        self.weight_bytes: int = weight_bytes(model)  # as held: quantized tensors at their own size
        weights_s, started = time.perf_counter() - started, time.perf_counter()
        settings = self.model.settings
        self.vocab_size: int = settings.vocab_size
        self.block_size: int = config.block_size
        self.max_model_len: int = resolve_max_model_len(config.max_model_len, self.hf_config)
        # The window every layer uses (None: some layer attends globally): blocks before it are released.
        self.kv_sliding_window: int | None = uniform_window(settings.layer_windows)
        self.attention_windows: set[int | None] = set(settings.layer_windows)
        # Embedding engines: how hidden states are pooled, the vector size, the longest input embedded.
        self.pooling: PoolingConfig | None = None
        self.embedding_size: int | None = None
        if self.task == "embed":
            self.pooling = pooling_config(config.model, is_encoder=False, method=config.pooling,
                                          normalize=config.normalize_embeddings)
            self.embedding_size = settings.hidden_size
            self.max_model_len = embedding_max_len(self.max_model_len, self.pooling)
        # Before the KV cache is sized: on CUDA the slots are part of what profiling finds in use.
        self.lora: LoRAManager | None = self._lora_manager() if config.max_loras else None
        layout = KVCacheLayout(num_layers=settings.num_layers, block_size=config.block_size,
                               num_kv_heads=settings.num_kv_heads, head_dim=settings.head_dim,
                               dtype=self.dtype)
        cuda_free = self._profile_cuda_free_bytes(layout) if self._needs_profiling() else None
        self.num_kv_blocks: int = plan_num_blocks(config, layout, self.max_model_len, cuda_free,
                                                  sliding_window=self.kv_sliding_window)
        self.kv_caches = allocate_kv_cache(layout, self.num_kv_blocks, self.device)
        self.load_timings = LoadTimings(weights_s=weights_s, kv_cache_s=time.perf_counter() - started,
                                        attention_s=attention_s)
        self.take_expert_load()  # the profiling forward's routing is not a step's
        self.last_forward_seconds: float = 0.0  # model forward + logits of the last step, inputs prepared
        logger.info("model runner ready: device=%s dtype=%s quantization=%s attention=%s max_model_len=%d",
                    self.device, self.dtype, self.quantization, self.attention_backend, self.max_model_len)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> RunnerOutput:
        """float32 logits [number of chunks with sample=True, vocab_size], in chunk order, and the prompt
        logprobs of the chunks that ask for them (computed in slices of at most max_num_seqs rows of logits,
        the most memory profiling planned for); for an embedding engine, each chunk's pooling row instead."""
        if not chunks:
            return RunnerOutput(torch.empty(0, self.vocab_size, device=self.device), [])
        self._check_chunks(chunks)
        step = prepare_step(chunks, self.block_size, self.device)
        start = time.perf_counter()
        lora = None
        if self.lora is not None:
            lora = self.lora.batch([c.lora for c in chunks], [len(c.token_ids) for c in chunks], self.device,
                                   triton=self.attention_backend == "triton")
        hidden, logits = self._forward(step, self.kv_caches, lora)
        pooled = None
        if self.pooling is not None:  # [S, H] fp32, on the CPU
            method = self.pooling.method
            pooled = chunk_rows(hidden, step.meta.query_start_loc, step.seq_of_token, method).cpu()
        prompt_logprobs = score_prompt_chunks(self.model.compute_logits, hidden, chunks,
                                              self.config.max_num_seqs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_forward_seconds = time.perf_counter() - start
        return RunnerOutput(logits, prompt_logprobs, pooled)

    def _forward(self, step: StepInputs, kv_caches: list[KVCache], lora: LoRABatch | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden states [T, H] and the logits at the sampled rows [N, V] fp32 (none when embedding:
        the model has no LM head)."""
        metas = attention_metas(step.meta, kv_caches[0][0], self.model.settings.num_heads,
                                self.attention_backend, self.attention_windows)
        hidden = self.model(step.input_ids, step.positions, metas, kv_caches, lora)  # [T, H]
        if self.pooling is not None:
            return hidden, torch.empty(0, self.vocab_size, device=hidden.device)
        return hidden, self.model.compute_logits(hidden[step.sample_indices])

    def take_expert_load(self) -> list[int]:
        """MoE models: tokens routed to each expert since the last call (summed over MoE layers); else []."""
        load = self.model.expert_load
        return load.take() if load is not None else []

    def _lora_manager(self) -> LoRAManager:
        c = self.config
        if self.task != "generate":
            raise ValueError("max_loras: LoRA adapters are served on generation models only")
        return LoRAManager(max_loras=c.max_loras, max_rank=c.max_lora_rank,
                           max_cpu_loras=c.max_cpu_loras if c.max_cpu_loras is not None else c.max_loras,
                           shapes=self.model.lora_shapes(), num_layers=self.model.settings.num_layers,
                           dtype=self.dtype, device=self.device)

    def _check_chunks(self, chunks: list[ScheduledChunk]) -> None:
        # The scheduler guarantees these; a violation would read or write outside the cache (silently, in a
        # Triton kernel), so check the cheap invariants on every step.
        for c in chunks:
            assert c.token_ids and c.seq_len <= self.max_model_len, (len(c.token_ids), c.seq_len)
            assert c.num_draft_tokens < len(c.token_ids) and (c.sample or not c.num_draft_tokens), c
            assert c.seq_len <= len(c.block_table) * self.block_size, "block table too short for the chunk"
            assert len(c.prompt_targets) <= len(c.token_ids), "more prompt targets than positions"
        assert max(max(c.block_table) for c in chunks) < self.num_kv_blocks, "block id out of range"

    # --- KV cache sizing on CUDA ------------------------------------------------------------------------

    def _needs_profiling(self) -> bool:
        c = self.config
        return self.device.type == "cuda" and c.num_kv_blocks is None and c.kv_cache_memory_bytes is None

    @torch.inference_mode()
    def _profile_cuda_free_bytes(self, layout: KVCacheLayout) -> int:
        """Runs a forward at max_num_batched_tokens and returns what is left for the KV cache."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        chunks = profiling_chunks(self.config.max_num_batched_tokens, self.config.max_num_seqs,
                                  self.max_model_len, layout.block_size)
        num_blocks = sum(len(c.block_table) for c in chunks)
        scratch_cache = allocate_kv_cache(layout, num_blocks, self.device)
        self._forward(prepare_step(chunks, self.block_size, self.device), scratch_cache)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - num_blocks * layout.bytes_per_block
        del scratch_cache
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        available = cuda_kv_budget_bytes(self.config.gpu_memory_utilization, total, free, reserved, peak)
        gib = 2**30
        logger.info("CUDA memory: total %.2f GiB, free %.2f GiB, torch peak (weights + activations) "
                    "%.2f GiB, left for the KV cache %.2f GiB", total / gib, free / gib, peak / gib,
                    available / gib)
        return available


def prepare_step(chunks: list[ScheduledChunk], block_size: int, device: torch.device) -> StepInputs:
    """Flattens the chunks into one batch: Python builds a few flat lists, tensor ops derive the rest."""
    query_lens = torch.tensor([len(c.token_ids) for c in chunks], dtype=torch.int64)  # [S]
    start_pos = torch.tensor([c.start_pos for c in chunks], dtype=torch.int64)  # [S]
    sample = torch.tensor([c.sample for c in chunks], dtype=torch.bool)  # [S]
    max_blocks = max(len(c.block_table) for c in chunks)
    block_tables = torch.tensor([c.block_table + [0] * (max_blocks - len(c.block_table)) for c in chunks],
                                dtype=torch.int32)  # [S, max_blocks]
    input_ids = torch.tensor(list(chain.from_iterable(c.token_ids for c in chunks)), dtype=torch.int64)  # [T]

    # NOTE: itertools, not repeat_interleave/searchsorted: those run multi-threaded even on tiny inputs and
    # cost milliseconds when the CPU is busy.
    seq_ids = chain.from_iterable(repeat(i, len(c.token_ids)) for i, c in enumerate(chunks))
    seq_of_token = torch.tensor(list(seq_ids), dtype=torch.int64)  # [T]
    query_start_loc = torch.zeros(len(chunks) + 1, dtype=torch.int64)
    torch.cumsum(query_lens, 0, out=query_start_loc[1:])  # [S + 1]
    offsets = torch.arange(input_ids.shape[0]) - query_start_loc[seq_of_token]  # [T], index within the chunk
    positions = start_pos[seq_of_token] + offsets  # [T]
    block_ids = block_tables[seq_of_token, positions // block_size].long()  # [T]
    slot_mapping = block_ids * block_size + positions % block_size  # [T]
    seq_lens = start_pos + query_lens  # [S]

    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(device, non_blocking=True),
        block_tables=block_tables.to(device, non_blocking=True),
        seq_lens=seq_lens.to(device=device, dtype=torch.int32, non_blocking=True),
        query_start_loc=query_start_loc.to(device=device, dtype=torch.int32, non_blocking=True),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
    )
    return StepInputs(
        input_ids=input_ids.to(device, non_blocking=True),
        positions=positions.to(device, non_blocking=True),
        meta=meta,
        sample_indices=_sample_indices(chunks, query_start_loc, sample).to(device, non_blocking=True),  # [N]
        seq_of_token=seq_of_token.to(device, non_blocking=True),
    )


def _sample_indices(chunks: list[ScheduledChunk], query_start_loc: torch.Tensor, sample: torch.Tensor
                    ) -> torch.Tensor:
    """[N] int64: the token rows whose logits are returned: the last one of each sampling chunk, or with
    drafts its last 1 + num_draft_tokens (row j scores the token after the chunk's first j drafts)."""
    if not any(c.num_draft_tokens for c in chunks):
        return (query_start_loc[1:] - 1)[sample]
    ends = query_start_loc[1:].tolist()
    return torch.tensor([end - c.num_logits_rows + j for c, end in zip(chunks, ends, strict=True)
                         for j in range(c.num_logits_rows)], dtype=torch.int64)


def profiling_chunks(num_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int
                     ) -> list[ScheduledChunk]:
    """A worst-case-ish step for memory profiling: the whole token budget, over as many sequences as allowed,
    each sampling (so logits are [max_num_seqs, V]); blocks numbered consecutively."""
    num_seqs = max(min(max_num_seqs, num_tokens), -(-num_tokens // max_model_len))
    lens = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
    chunks, next_block = [], 0
    for length in lens:
        blocks = list(range(next_block, next_block + -(-length // block_size)))
        chunks.append(ScheduledChunk(token_ids=[0] * length, start_pos=0, block_table=blocks, sample=True))
        next_block += len(blocks)
    return chunks


def resolve_max_model_len(requested: int | None, hf_config: dict[str, Any]) -> int:
    """`requested`, or the model's max_position_embeddings when None; never beyond it. (Sliding-window
    layers attend within their window at any length: the window does not cap the context.)"""
    limit = int(hf_config["max_position_embeddings"])
    if requested is not None and requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds the model's max_position_embeddings={limit}")
    return requested if requested is not None else limit
