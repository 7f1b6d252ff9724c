"""Architecture name (config.json `architectures[0]`) -> model builder.

Two kinds of model: decoders (`LlamaForCausalLM`, generation and last-token embeddings) and encoders
(`BertEncoder`, embeddings only; `is_encoder` is True on them). A decoder saved without its LM head
(`LlamaModel`, ..., as sentence-transformers saves one) is built as its *ForCausalLM counterpart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.models.bert import BertEncoder, bert_settings, xlm_roberta_settings
from engine.models.llama import LlamaForCausalLM, LlamaSettings

Model = LlamaForCausalLM | BertEncoder
ModelBuilder = Callable[[dict[str, Any], torch.dtype, str], Model]


def _llama(cfg: dict[str, Any], dtype: torch.dtype, attention_backend: str) -> LlamaForCausalLM:
    bias, mlp_bias = cfg.get("attention_bias", False), cfg.get("mlp_bias", False)
    settings = LlamaSettings.from_hf(cfg, dtype, qkv_bias=bias, o_bias=bias, mlp_bias=mlp_bias, qk_norm=False)
    return LlamaForCausalLM(settings, attention_backend)


def _mistral(cfg: dict[str, Any], dtype: torch.dtype, attention_backend: str) -> LlamaForCausalLM:
    settings = LlamaSettings.from_hf(cfg, dtype, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)
    return LlamaForCausalLM(settings, attention_backend)


def _qwen2(cfg: dict[str, Any], dtype: torch.dtype, attention_backend: str) -> LlamaForCausalLM:
    # Qwen2 always has q/k/v biases (whatever `attention_bias` says) and none on o_proj.
    settings = LlamaSettings.from_hf(cfg, dtype, qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False)
    return LlamaForCausalLM(settings, attention_backend)


def _qwen3(cfg: dict[str, Any], dtype: torch.dtype, attention_backend: str) -> LlamaForCausalLM:
    bias = cfg.get("attention_bias", False)
    settings = LlamaSettings.from_hf(cfg, dtype, qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True)
    return LlamaForCausalLM(settings, attention_backend)


def _bert(cfg: dict[str, Any], dtype: torch.dtype, attention_backend: str) -> BertEncoder:
    del attention_backend  # no paged attention: the encoder attends within each packed sequence itself
    return BertEncoder(bert_settings(cfg, dtype))


def _xlm_roberta(cfg: dict[str, Any], dtype: torch.dtype, attention_backend: str) -> BertEncoder:
    del attention_backend
    return BertEncoder(xlm_roberta_settings(cfg, dtype))


MODEL_REGISTRY: dict[str, ModelBuilder] = {
    "LlamaForCausalLM": _llama,
    "LlamaModel": _llama,
    "MistralForCausalLM": _mistral,
    "MistralModel": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen2Model": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "Qwen3Model": _qwen3,
    # The masked-LM checkpoints hold the same encoder (under `bert.` / `roberta.`) plus a head it ignores.
    "BertModel": _bert,
    "BertForMaskedLM": _bert,
    "XLMRobertaModel": _xlm_roberta,
    "XLMRobertaForMaskedLM": _xlm_roberta,
}


def build_model(hf_config: dict[str, Any], dtype: torch.dtype, attention_backend: str) -> Model:
    """The (uninitialised) model named by `hf_config["architectures"]`, parameters in `dtype`."""
    archs = hf_config.get("architectures") or []
    supported = [a for a in archs if a in MODEL_REGISTRY]
    if not supported:
        raise ValueError(
            f"config.json: unsupported architecture {archs!r}; supported: {list(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[supported[0]](hf_config, dtype, attention_backend)
