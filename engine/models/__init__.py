"""Architecture name (config.json `architectures[0]`) -> model builder.

Two kinds of model: decoders (`LlamaForCausalLM`, generation and last-token embeddings; Gemma's is a
`GemmaForCausalLM`, the same interface over its own decoder stack) and encoders (`BertEncoder`, embeddings
only; `is_encoder` is True on them). A decoder saved without its LM head (`LlamaModel`, ..., as
sentence-transformers saves one) is built as its *ForCausalLM counterpart. Mixtures of experts (Mixtral,
Qwen2-MoE, Qwen3-MoE) are Llama decoders whose MLPs are `SparseMoE` blocks (engine/models/moe.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from conveyor.engine.models.bert import BertEncoder, bert_settings, xlm_roberta_settings
from conveyor.engine.models.gemma import GemmaForCausalLM, gemma_settings
from conveyor.engine.models.llama import LlamaForCausalLM, LlamaSettings
from conveyor.engine.models.moe import MoESettings

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


def _phi3(cfg: dict[str, Any], dtype: torch.dtype, attention_backend: str) -> LlamaForCausalLM:
    # Phi-3 is Llama with its q/k/v and gate/up already fused in the checkpoint (the loader takes them whole).
    settings = LlamaSettings.from_hf(cfg, dtype, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)
    return LlamaForCausalLM(settings, attention_backend)


def _mixtral(cfg: dict[str, Any], dtype: torch.dtype, attention_backend: str) -> LlamaForCausalLM:
    # Softmax over the experts, top-k, the k weights renormalised (always, in Mixtral).
    moe = MoESettings(num_experts=_required(cfg, "num_local_experts"),
                      top_k=_required(cfg, "num_experts_per_tok"),
                      intermediate_size=_required(cfg, "intermediate_size"), renormalize=True)
    settings = LlamaSettings.from_hf(cfg, dtype, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
                                     moe=moe)
    return LlamaForCausalLM(settings, attention_backend)


def _qwen_moe(cfg: dict[str, Any], dtype: torch.dtype, attention_backend: str, *, qk_norm: bool,
              shared_expert: bool) -> LlamaForCausalLM:
    # Softmax, top-k, renormalised only with norm_topk_prob; the layers in mlp_only_layers, and those off the
    # decoder_sparse_step, keep a dense MLP of intermediate_size.
    num_layers, step = cfg.get("num_hidden_layers") or 0, cfg.get("decoder_sparse_step", 1) or 1
    dense = set(cfg.get("mlp_only_layers") or [])
    # transformers 5 writes num_local_experts where the published checkpoints say num_experts.
    experts_key = "num_experts" if "num_experts" in cfg else "num_local_experts"
    shared = _required(cfg, "shared_expert_intermediate_size") if shared_expert else None
    moe = MoESettings(num_experts=_required(cfg, experts_key), top_k=_required(cfg, "num_experts_per_tok"),
                      intermediate_size=_required(cfg, "moe_intermediate_size"),
                      renormalize=bool(cfg.get("norm_topk_prob", False)), shared_intermediate_size=shared)
    moe_layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    if qk_norm:  # Qwen3-MoE: attention_bias on every projection, as Qwen3
        qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
    else:  # Qwen2-MoE: q/k/v biases unless qkv_bias says otherwise, none on o_proj
        qkv_bias, o_bias = bool(cfg.get("qkv_bias", True)), False
    settings = LlamaSettings.from_hf(cfg, dtype, qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=False,
                                     qk_norm=qk_norm, moe=moe, moe_layers=moe_layers)
    return LlamaForCausalLM(settings, attention_backend)


def _qwen2_moe(cfg: dict[str, Any], dtype: torch.dtype, attention_backend: str) -> LlamaForCausalLM:
    return _qwen_moe(cfg, dtype, attention_backend, qk_norm=False, shared_expert=True)


def _qwen3_moe(cfg: dict[str, Any], dtype: torch.dtype, attention_backend: str) -> LlamaForCausalLM:
    return _qwen_moe(cfg, dtype, attention_backend, qk_norm=True, shared_expert=False)


def _gemma2(cfg: dict[str, Any], dtype: torch.dtype, attention_backend: str) -> GemmaForCausalLM:
    return GemmaForCausalLM(*gemma_settings(cfg, dtype, qk_norm=False), attention_backend)


def _gemma3(cfg: dict[str, Any], dtype: torch.dtype, attention_backend: str) -> GemmaForCausalLM:
    return GemmaForCausalLM(*gemma_settings(cfg, dtype, qk_norm=True), attention_backend)


def _required(cfg: dict[str, Any], key: str) -> int:
    if not isinstance(cfg.get(key), int) or cfg[key] < 1:
        raise ValueError(f"config.json: {key} must be a positive integer, got {cfg.get(key)!r}")
    return int(cfg[key])


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
    "Phi3ForCausalLM": _phi3,
    "MixtralForCausalLM": _mixtral,
    "Qwen2MoeForCausalLM": _qwen2_moe,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "Gemma2ForCausalLM": _gemma2,
    "Gemma3ForCausalLM": _gemma3,
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
        named = ", ".join(archs) if archs else "none (config.json has no architectures)"
        raise ValueError(f"config.json: unsupported architecture {named}; "
                         f"supported: {', '.join(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[supported[0]](hf_config, dtype, attention_backend)
