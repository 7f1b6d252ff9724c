"""The runner seam: what the engine needs from a model runner (`Runner`), and `make_runner`, which loads the
one config.model names. Tests hand LLMEngine a double instead (tests/support/fake_runner.py)."""

from __future__ import annotations

from typing import Protocol

import torch

from conveyor.engine.config import EngineConfig
from conveyor.engine.scheduled_chunk import RunnerOutput, ScheduledChunk


class Runner(Protocol):
    """What the engine needs from the model runner (conveyor.engine.model_runner.ModelRunner,
    conveyor.engine.encoder_runner.EncoderRunner, or a test double).

    An embedding runner also has `task` "embed", `pooling` (PoolingConfig) and `embedding_size`, and returns
    RunnerOutput.pooled; an encoder's has `is_encoder` True. A runner without them generates text. One whose
    every layer attends within the same sliding window has `kv_sliding_window` (that window; None or absent:
    some layer attends to the whole context).
    """

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    device: torch.device
    last_forward_seconds: float

    # The logits [num sampling chunks, V] fp32 and the prompt logprobs of the chunks that ask for them; a
    # double may return the logits alone (it computes no prompt logprobs).
    def execute(self, chunks: list[ScheduledChunk]) -> RunnerOutput: ...


def make_runner(config: EngineConfig) -> Runner:
    """The runner for config.model, its weights loaded: an EncoderRunner for an encoder (BERT, XLM-R),
    else a ModelRunner (paged KV cache)."""
    from conveyor.engine.loader import is_encoder_config, read_hf_config

    if is_encoder_config(read_hf_config(config.model)):
        from conveyor.engine.encoder_runner import EncoderRunner

        return EncoderRunner(config)
    from conveyor.engine.model_runner import ModelRunner

    return ModelRunner(config)
