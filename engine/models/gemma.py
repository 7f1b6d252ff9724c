"""Gemma 2 and Gemma 3 (text): the Llama decoder's parts, rearranged the Gemma way.

What differs from Llama, top to bottom:
- embeddings scaled by sqrt(hidden_size) (rounded to the parameter dtype, as the checkpoints were trained);
- RMSNorm multiplies by (1 + weight), in fp32, and every layer has four: before and after attention, before
  and after the MLP ("sandwich" norms);
- the MLP is GeGLU (gelu, tanh approximation) instead of SwiGLU;
- attention scaled by query_pre_attn_scalar ** -0.5; Gemma 2 soft-caps the scores (attn_logit_softcapping)
  and the final logits (final_logit_softcapping); Gemma 3 norms q and k per head instead;
- sliding-window layers alternate with global ones (Gemma 2: every other layer; Gemma 3: five in six), and
  in Gemma 3 the two kinds rotate with their own RoPE (a local base frequency; the global layers' may be
  linearly scaled).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from conveyor.engine.attention import KVCache, StepAttention
from conveyor.engine.lora.batch import LoRABatch
from conveyor.engine.models.layer_config import FULL, SLIDING, layer_windows, normalised_config
from conveyor.engine.models.llama import (
    MLP,
    Attention,
    Embedding,
    LlamaForCausalLM,
    LlamaSettings,
    RMSNorm,
    RotaryEmbedding,
    Rotation,
    parse_rope,
    require_keys,
)


@dataclass(frozen=True)
class GemmaSettings:
    query_pre_attn_scalar: float
    attn_softcap: float | None  # Gemma 2's attn_logit_softcapping
    final_softcap: float | None  # Gemma 2's final_logit_softcapping
    sliding_rope: tuple[float, dict[str, Any] | None] | None  # Gemma 3's (theta, scaling) of sliding layers


def gemma_settings(cfg: dict[str, Any], dtype: torch.dtype, *, qk_norm: bool) -> tuple[LlamaSettings,
                                                                                        GemmaSettings]:
    """(the shared decoder settings, Gemma's own) from config.json, legacy spellings normalised."""
    require_keys(cfg)
    cfg = normalised_config(cfg)
    rope = cfg.get("rope_parameters") or {}
    per_type = isinstance(rope.get(FULL), dict)  # Gemma 3: rope_parameters per layer type
    global_cfg = {**cfg, "rope_parameters": rope[FULL]} if per_type else cfg
    bias = bool(cfg.get("attention_bias"))
    windows = layer_windows(cfg, cfg["num_hidden_layers"])
    base = LlamaSettings.from_hf(global_cfg, dtype, qkv_bias=bias, o_bias=bias, mlp_bias=False,
                                 qk_norm=qk_norm, windows=windows)
    sliding_rope = parse_rope({"rope_parameters": rope[SLIDING]}) if per_type and rope.get(SLIDING) else None
    gemma = GemmaSettings(query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or base.head_dim),
                          attn_softcap=cfg.get("attn_logit_softcapping"),
                          final_softcap=cfg.get("final_logit_softcapping"), sliding_rope=sliding_rope)
    return base, gemma


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight), all in fp32, cast back at the end (the checkpoints' convention)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, s: LlamaSettings, g: GemmaSettings, attention_backend: str, layer: int) -> None:
        super().__init__()
        norm = [GemmaRMSNorm(s.hidden_size, s.rms_norm_eps, s.dtype) for _ in range(4)]
        self.input_layernorm, self.post_attention_layernorm = norm[0], norm[1]
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm[2], norm[3]
        self.self_attn = Attention(s, attention_backend, layer, norm=GemmaRMSNorm,
                                   scale=g.query_pre_attn_scalar**-0.5, softcap=g.attn_softcap)
        self.mlp = MLP(s, fused=False, layer=layer)

    def forward(
        self, x: torch.Tensor, rotation: Rotation, kv_cache: KVCache, metas: StepAttention,
        lora: LoRABatch | None,
    ) -> torch.Tensor:  # [T, H]
        attended = self.self_attn(self.input_layernorm(x), rotation, kv_cache, metas, lora)
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x), lora))


class GemmaModel(nn.Module):
    def __init__(self, s: LlamaSettings, g: GemmaSettings, attention_backend: str) -> None:
        super().__init__()
        self.embed_tokens = Embedding(s.vocab_size, s.hidden_size, s.dtype)
        self.embed_scale = s.hidden_size**0.5
        self.rotary = RotaryEmbedding(s.head_dim, s.rope_theta, s.rope_scaling)
        # Gemma 3's sliding layers rotate with their own (local) frequencies; Gemma 2's with the global ones.
        self.sliding_rotary = RotaryEmbedding(s.head_dim, *g.sliding_rope) if g.sliding_rope else None
        self.layers = nn.ModuleList(GemmaDecoderLayer(s, g, attention_backend, i)
                                    for i in range(s.num_layers))
        self.windows = s.layer_windows
        self.norm = GemmaRMSNorm(s.hidden_size, s.rms_norm_eps, s.dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metas: StepAttention,
        kv_caches: list[KVCache], lora: LoRABatch | None = None,
    ) -> torch.Tensor:  # [T, H]
        x = self.embed_tokens(input_ids)  # [T, H]
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # the scale rounded to the dtype first
        rotation = self.rotary(positions, x.dtype)
        sliding = self.sliding_rotary(positions, x.dtype) if self.sliding_rotary is not None else rotation
        for layer, kv_cache, window in zip(self.layers, kv_caches, self.windows, strict=True):
            x = layer(x, rotation if window is None else sliding, kv_cache, metas, lora)
        return self.norm(x)


class GemmaForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM's interface (settings, LM head tied or not, LoRA targets) over Gemma's decoder."""

    def __init__(self, s: LlamaSettings, g: GemmaSettings, attention_backend: str) -> None:
        super().__init__(s, attention_backend, decoder=GemmaModel(s, g, attention_backend))
        self.final_softcap = g.final_softcap

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] fp32
        logits = super().compute_logits(hidden)
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap
