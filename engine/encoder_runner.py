"""The encoder runner: runs a BERT-style encoder (engine/models/bert.py) for an embedding engine.

Attention is bidirectional, so a request's input cannot be computed in chunks: the scheduler never splits
an encoder's request (Scheduler(chunked=False)), and each step packs whole inputs into one forward. Nothing
is cached between steps, so no KV cache memory is allocated and prefix caching is off. The block manager
still hands block ids out (bookkeeping integers only, no memory behind them), which keeps the scheduler
unchanged; there are enough of them for any step's requests, so none ever waits for blocks or is
preempted.
"""

from __future__ import annotations

import logging
import time

import torch

from conveyor.engine.config import EngineConfig
from conveyor.engine.loader import (
    LoadTimings,
    check_tokenizer_files,
    load_model,
    resolve_device,
    resolve_dtype,
)
from conveyor.engine.model_runner import prepare_step
from conveyor.engine.models.bert import BertEncoder
from conveyor.engine.pooling import PoolingConfig, chunk_rows, embedding_max_len, pooling_config
from conveyor.engine.quantization import weight_bytes
from conveyor.engine.scheduled_chunk import RunnerOutput, ScheduledChunk
from conveyor.kernels.paged_attention import resolve_backend

logger = logging.getLogger("conveyor.engine")


class EncoderRunner:
    is_encoder = True
    task = "embed"

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        check_tokenizer_files(config.model)
        started = time.perf_counter()
        # Quantized projections use the device's kernels (the C++ ones on CPU), whatever attention uses.
        model, self.hf_config, task, self.quantization = load_model(
            config.model, self.device, self.dtype, "torch", config.task, config.quantization,
            kernels=resolve_backend(config.attention_backend, self.device))
        assert isinstance(model, BertEncoder) and task == "embed", (type(model).__name__, task)
        self.model = model
        self.weight_bytes: int = weight_bytes(model)
        settings = model.settings
        self.vocab_size: int = settings.vocab_size
        self.embedding_size: int = settings.hidden_size
        self.pooling: PoolingConfig = pooling_config(config.model, is_encoder=True, method=config.pooling,
                                                     normalize=config.normalize_embeddings)
        self.max_model_len: int = embedding_max_len(
            encoder_max_len(config.max_model_len, settings.max_positions), self.pooling)
        self.block_size: int = config.block_size
        self.num_kv_blocks: int = bookkeeping_blocks(config, self.max_model_len)
        self.load_timings = LoadTimings(weights_s=time.perf_counter() - started, kv_cache_s=0.0)
        self.last_forward_seconds: float = 0.0
        logger.info("encoder runner ready: device=%s dtype=%s max_model_len=%d pooling=%s", self.device,
                    self.dtype, self.max_model_len, self.pooling.method)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> RunnerOutput:
        """Each chunk's pooling row [S, H] fp32 on the CPU (engine/pooling.py chunk_rows); no logits."""
        no_logits = torch.empty(0, self.vocab_size)
        if not chunks:
            return RunnerOutput(no_logits, [], torch.empty(0, self.embedding_size))
        for c in chunks:  # the scheduler guarantees whole inputs, within the model's positions
            assert c.start_pos == 0 and not c.sample and not c.prompt_targets, c.start_pos
            assert 0 < len(c.token_ids) <= self.max_model_len, len(c.token_ids)
        step = prepare_step(chunks, self.block_size, self.device)
        start = time.perf_counter()
        query_start_loc = step.meta.query_start_loc  # [S + 1]
        hidden = self.model(step.input_ids, step.positions, query_start_loc, step.meta.max_seq_len)  # [T, H]
        pooled = chunk_rows(hidden, query_start_loc, step.seq_of_token, self.pooling.method).cpu()  # [S, H]
        self.last_forward_seconds = time.perf_counter() - start
        return RunnerOutput(no_logits, [None] * len(chunks), pooled)


def encoder_max_len(requested: int | None, max_positions: int) -> int:
    """`requested` (EngineConfig.max_model_len), or the positions the encoder can use; never beyond them."""
    if requested is not None and requested > max_positions:
        raise ValueError(f"max_model_len={requested} exceeds the encoder's {max_positions} positions")
    return requested if requested is not None else max_positions


def bookkeeping_blocks(config: EngineConfig, max_model_len: int) -> int:
    """Block ids enough for any one step: its tokens (the budget, at least max_model_len for an encoder)
    in whole blocks, plus one partial block per sequence."""
    budget = max(config.max_num_batched_tokens, max_model_len)
    return -(-budget // config.block_size) + config.max_num_seqs
