"""The Llama family (Llama, Mistral, Qwen2, Qwen3, Phi-3, and with expert layers Mixtral, Qwen2/3-MoE) as
one decoder, switched by a few settings: biases, q/k norms, a sliding window per layer, MoE layers.

Reads top to bottom: settings parsed from config.json, RMSNorm, rotary embedding, attention, MLP, decoder
layer, model. The forward pass takes one flattened step (every scheduled token of every sequence,
concatenated) and reads/writes K/V through the paged cache. Parameters are allocated uninitialised; the
loader fills every one of them from the checkpoint and checks none was missed.

Fused projections: q/k/v live in one `qkv_proj`, gate/up in one `gate_up_proj` (one matmul each instead
of three and two); engine/models/checkpoint_names.py tells the loader where the checkpoint's tensors go.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.engine.attention import KVCache, PagedAttention, StepAttention
from conveyor.engine.lora.adapter import TargetShape
from conveyor.engine.lora.batch import LoRABatch
from conveyor.engine.models.layer_config import layer_windows, normalised_config
from conveyor.engine.models.moe import ExpertLoad, MoESettings, SparseMoE
from conveyor.kernels.cpu_fused import rms_norm_cpu, rotate_half_cpu_, silu_and_mul_cpu

ROPE_TYPES = ("default", "llama3", "linear")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "max_position_embeddings")


@dataclass(frozen=True)
class LlamaSettings:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # llama3 or linear parameters; None for plain RoPE
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before RoPE
    tie_word_embeddings: bool
    dtype: torch.dtype  # of every parameter (RoPE angles are always computed in fp32)
    hidden_act: str  # the MLP's activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma's GeGLU)
    layer_windows: tuple[int | None, ...]  # [num_layers]: each layer's sliding window; None: full attention
    moe: MoESettings | None = None  # the expert layers' routing and widths; None: a dense model
    moe_layers: tuple[bool, ...] = ()  # [num_layers] with `moe`: True where the MLP is a SparseMoE

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe_layers[layer]

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], dtype: torch.dtype, *, qkv_bias: bool, o_bias: bool,
                mlp_bias: bool, qk_norm: bool, moe: MoESettings | None = None,
                moe_layers: tuple[bool, ...] = (), windows: tuple[int | None, ...] | None = None,
                ) -> LlamaSettings:
        """windows: each layer's attention window when the caller has read them (Gemma); else from cfg."""
        require_keys(cfg)
        # Gemma names it hidden_activation (its hidden_act, when present, is a legacy alias).
        hidden_act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"config.json: hidden_act {hidden_act!r} is not supported; supported: "
                             f"{list(ACTIVATIONS)}")
        if cfg.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"config.json: partial_rotary_factor {cfg['partial_rotary_factor']} is not "
                             "supported (only 1.0: RoPE over the whole head)")
        num_heads, num_layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
        rope_theta, rope_scaling = parse_rope(cfg)
        if moe is not None and not moe_layers:
            moe_layers = (True,) * num_layers  # every layer's MLP is a mixture of experts (Mixtral)
        assert moe is None or len(moe_layers) == num_layers, (len(moe_layers), num_layers)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg["max_position_embeddings"],
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=qk_norm,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            dtype=dtype,
            hidden_act=hidden_act,
            layer_windows=layer_windows(normalised_config(cfg), num_layers) if windows is None else windows,
            moe=moe,
            moe_layers=moe_layers,
        )


def require_keys(cfg: dict[str, Any]) -> None:
    """The keys every decoder's config.json must name (checked before transformers' config classes fill in
    their defaults)."""
    missing = [key for key in REQUIRED_KEYS if key not in cfg]
    if missing:
        raise ValueError(f"config.json: missing key(s) {missing}")


def parse_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, llama3 or linear scaling or None) from either `rope_parameters` (transformers 5) or the older
    top-level `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling: unsupported rope_type {rope_type!r}; supported: {list(ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        if not isinstance(params.get("factor"), int | float) or params["factor"] <= 0:
            raise ValueError(f"rope_scaling: linear needs a positive factor, got {params.get('factor')!r}")
        return theta, {"rope_type": "linear", "factor": float(params["factor"])}
    missing = [key for key in LLAMA3_KEYS if key not in params]
    if missing:
        raise ValueError(f"rope_scaling: llama3 needs {list(LLAMA3_KEYS)}, missing {missing}")
    return theta, params


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, fused: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))
        self.eps = eps
        self.fused = fused  # the cpu backend's one-pass kernel, for [T, dim] inputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        if self.fused and x.dim() == 2:
            return rms_norm_cpu(x, self.weight, self.eps)
        # Normalise in fp32 and cast back before the weight, as transformers does (bit-level parity).
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


Rotation = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, 1, D] each


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE. cos/sin come from the step's positions in fp32, once per step for all layers."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # [D/2]
        inv_freq = 1.0 / theta**exponents  # [D/2], fp32
        if scaling is not None and scaling.get("rope_type") == "linear":
            inv_freq = inv_freq / scaling["factor"]  # positions divided by factor (Gemma 3's global layers)
        elif scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:  # positions [T]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotation(x: torch.Tensor, rotation: Rotation, fused: bool = False) -> torch.Tensor:  # [T, H, D]
    """fused: the cpu backend's kernel, which rotates x in place (a fresh projection's view) in one pass."""
    cos, sin = rotation
    if fused:
        return rotate_half_cpu_(x, cos.view(cos.shape[0], -1), sin.view(sin.shape[0], -1))
    return x * cos + rotate_half(x) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:  # [..., D]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 long-context scaling: slow (long-wavelength) frequencies divided by `factor`, fast ones
    kept, the band between interpolated smoothly."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(in_band, smoothed, scaled)


class Attention(nn.Module):
    """norm: the q/k norm's class (Gemma's differs); scale, softcap: PagedAttention's (Gemma's own)."""

    def __init__(self, s: LlamaSettings, attention_backend: str, layer: int, *,
                 norm: type[RMSNorm] | None = None, scale: float | None = None, softcap: float | None = None,
                 ) -> None:
        super().__init__()
        norm = RMSNorm if norm is None else norm
        self.layer = layer  # its index: where its LoRA weights are found
        self.q_size = s.num_heads * s.head_dim
        self.kv_size = s.num_kv_heads * s.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, s.head_dim
        self.fused = attention_backend == "cpu"
        self.qkv_proj = Linear(s.hidden_size, self.q_size + 2 * self.kv_size, s.qkv_bias, s.dtype)
        self.o_proj = Linear(self.q_size, s.hidden_size, s.o_bias, s.dtype)
        self.q_norm = norm(s.head_dim, s.rms_norm_eps, s.dtype) if s.qk_norm else None
        self.k_norm = norm(s.head_dim, s.rms_norm_eps, s.dtype) if s.qk_norm else None
        self.attn = PagedAttention(s.num_heads, s.num_kv_heads, s.head_dim, attention_backend,
                                   window=s.layer_windows[layer], softcap=softcap, scale=scale)

    def forward(
        self, x: torch.Tensor, rotation: Rotation, kv_cache: KVCache, metas: StepAttention,
        lora: LoRABatch | None,
    ) -> torch.Tensor:  # [T, H]
        qkv = self.qkv_proj(x)  # [T, q + 2 kv]
        if lora is not None:
            lora.apply(self.layer, "qkv", x, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotation(q, rotation, self.fused), apply_rotation(k, rotation, self.fused)
        out = self.attn(q, k, v, kv_cache, metas).reshape(-1, self.q_size)  # [T, Hq * D]
        projected = self.o_proj(out)  # [T, H]
        if lora is not None:
            lora.apply(self.layer, "o", out, projected)
        return projected


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); GeGLU (Gemma) with gelu's tanh approximation instead of silu."""

    def __init__(self, s: LlamaSettings, fused: bool, layer: int = 0) -> None:
        super().__init__()
        self.layer = layer  # its index: where its LoRA weights are found
        self.gate_up_proj = Linear(s.hidden_size, 2 * s.intermediate_size, s.mlp_bias, s.dtype)
        self.down_proj = Linear(s.intermediate_size, s.hidden_size, s.mlp_bias, s.dtype)
        self.fused = fused and s.hidden_act == "silu"  # the cpu backend's one-pass silu(gate) * up
        self.gelu = s.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:  # [T, H]
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        if lora is not None:
            lora.apply(self.layer, "gate_up", x, gate_up)
        if self.fused:
            hidden = silu_and_mul_cpu(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
            hidden = (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up
        out = self.down_proj(hidden)  # [T, H]
        if lora is not None:
            lora.apply(self.layer, "down", hidden, out)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, s: LlamaSettings, attention_backend: str, layer: int, load: ExpertLoad | None) -> None:
        super().__init__()
        fused = attention_backend == "cpu"
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps, s.dtype, fused)
        self.self_attn = Attention(s, attention_backend, layer)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps, s.dtype, fused)
        self.mlp: MLP | SparseMoE
        if s.moe is not None and s.is_moe_layer(layer):
            assert load is not None, "an MoE layer counts its routing into the model's ExpertLoad"
            # The experts' kernel follows the attention backend's device choice: Triton on CUDA.
            experts_backend = "triton" if attention_backend == "triton" else "torch"
            self.mlp = SparseMoE(s.hidden_size, s.moe, s.dtype, experts_backend, load)
        else:
            self.mlp = MLP(s, fused, layer)
        self.mlp_takes_lora = s.moe is None

    def forward(
        self, x: torch.Tensor, rotation: Rotation, kv_cache: KVCache, metas: StepAttention,
        lora: LoRABatch | None,
    ) -> torch.Tensor:  # [T, H]
        x = x + self.self_attn(self.input_layernorm(x), rotation, kv_cache, metas, lora)
        hidden = self.post_attention_layernorm(x)
        if isinstance(self.mlp, SparseMoE):
            return x + self.mlp(hidden)
        # An MoE model's adapters target attention only, its dense layers' MLPs included.
        return x + self.mlp(hidden, lora if self.mlp_takes_lora else None)


class LlamaModel(nn.Module):
    def __init__(self, s: LlamaSettings, attention_backend: str, load: ExpertLoad | None) -> None:
        super().__init__()
        self.embed_tokens = Embedding(s.vocab_size, s.hidden_size, s.dtype)
        self.rotary = RotaryEmbedding(s.head_dim, s.rope_theta, s.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(s, attention_backend, i, load) for i in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps, s.dtype, attention_backend == "cpu")

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metas: StepAttention,
        kv_caches: list[KVCache], lora: LoRABatch | None = None,
    ) -> torch.Tensor:  # [T, H]
        x = self.embed_tokens(input_ids)  # [T, H]
        rotation = self.rotary(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rotation, kv_cache, metas, lora)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """The decoder with its LM head. `expert_load` (MoE models): tokens per expert since it was last taken."""

    def __init__(self, s: LlamaSettings, attention_backend: str, decoder: nn.Module | None = None) -> None:
        """decoder: another family's decoder stack over the same settings (Gemma); None: LlamaModel."""
        super().__init__()
        self.settings = s
        self.expert_load = ExpertLoad(s.moe.num_experts) if s.moe is not None else None
        self.model = decoder if decoder is not None else LlamaModel(s, attention_backend, self.expert_load)
        # Tied: one parameter, loaded once as model.embed_tokens.weight (named_parameters() lists it once).
        tied = self.model.embed_tokens.weight if s.tie_word_embeddings else None
        self.lm_head = Linear(s.hidden_size, s.vocab_size, False, s.dtype, weight=tied)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metas: StepAttention,
        kv_caches: list[KVCache], lora: LoRABatch | None = None,
    ) -> torch.Tensor:  # [T] ids, [T] positions -> [T, H] final hidden states
        """metas: the step's attention metadata per window (engine/attention.py attention_metas); lora: the
        step's adapters (engine/lora/batch.py), None: the base model for every token."""
        return self.model(input_ids, positions, metas, kv_caches, lora)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] fp32
        return self.lm_head(hidden).float()

    def packed_shard_sizes(self) -> dict[str, list[int]]:
        """Rows of each checkpoint tensor inside our fused parameters, in shard order (q, k, v; gate, up)."""
        s = self.settings
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        return {"qkv_proj": [q, kv, kv], "gate_up_proj": [s.intermediate_size, s.intermediate_size]}

    def lora_shapes(self) -> dict[str, TargetShape]:
        """The widths of each projection a LoRA adapter may target, by PEFT's module name; an MoE model's
        adapters may target attention only (its experts are not LoRA targets)."""
        s = self.settings
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        h, i = s.hidden_size, s.intermediate_size
        attention = {"q_proj": TargetShape(h, q), "k_proj": TargetShape(h, kv), "v_proj": TargetShape(h, kv),
                     "o_proj": TargetShape(q, h)}
        if s.moe is not None:
            return attention
        return {**attention, "gate_proj": TargetShape(h, i), "up_proj": TargetShape(h, i),
                "down_proj": TargetShape(i, h)}


# nn.Linear and nn.Embedding without their random init: the loader overwrites every weight anyway.


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 weight: nn.Parameter | None = None) -> None:  # weight: an existing parameter to share
        super().__init__()
        if weight is None:
            weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.weight = weight
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        return F.embedding(ids, self.weight)
