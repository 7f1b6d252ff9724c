"""The mixture-of-experts feed-forward block: a router picks each token's top-k experts, the experts run
grouped (`conveyor.kernels.moe.fused_moe`: tokens sorted by expert, each expert's rows in one matmul; fused
Triton on CUDA), an optional shared expert runs for every token.

Routing as the families define it, all through `MoESettings`:
- Mixtral: softmax over every expert, top-k, the k weights renormalised to sum to 1.
- Qwen3-MoE / Qwen2-MoE: softmax, top-k, renormalised only when `norm_topk_prob`.
- Qwen2-MoE (DeepSeek-style) shared expert: a dense SwiGLU MLP for every token, scaled by sigmoid(gate(x)).

Every expert is a SwiGLU MLP; the stacked weights hold all experts of the layer:
`w_gate_up` [E, 2I, H] (gate rows then up rows, as F.linear weights) and `w_down` [E, H, I].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.kernels.moe import expert_token_counts, fused_moe


@dataclass(frozen=True)
class MoESettings:
    num_experts: int  # E
    top_k: int  # K experts per token
    intermediate_size: int  # I, of each expert
    renormalize: bool  # the K routing weights divided by their sum
    shared_intermediate_size: int | None = None  # a shared expert's width; None: no shared expert

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"config.json: num_experts_per_tok={self.top_k} must be in [1, num_experts="
                             f"{self.num_experts}]")


class ExpertLoad:
    """Tokens routed to each expert, summed over the MoE layers of the forwards since the last `take`:
    the load-balancing figure of a step (step stats, the bench)."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self._counts: torch.Tensor | None = None  # [E] int64 on the model's device; summed lazily

    def add(self, topk_ids: torch.Tensor) -> None:  # [T, K]
        counts = expert_token_counts(topk_ids, self.num_experts)
        self._counts = counts if self._counts is None else self._counts + counts

    def take(self) -> list[int]:
        """The counts since the last take (one device sync), then zero."""
        counts = [0] * self.num_experts if self._counts is None else self._counts.tolist()
        self._counts = None
        return counts


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, s: MoESettings, dtype: torch.dtype, backend: str | None,
                 load: ExpertLoad) -> None:
        super().__init__()
        self.settings, self.backend, self.load = s, backend, load
        e, i = s.num_experts, s.intermediate_size
        self.gate = nn.Parameter(torch.empty(e, hidden_size, dtype=dtype))  # router [E, H]
        transposed = backend != "triton"
        self.w_gate_up = expert_weights(e, 2 * i, hidden_size, dtype, transposed)  # [E, 2I, H]
        self.w_down = expert_weights(e, hidden_size, i, dtype, transposed)  # [E, H, I]
        # Set once the experts are quantized (engine/quantization.py), w_gate_up and w_down then dropped.
        self.experts: nn.Module | None = None
        self.shared: SharedExpert | None = None
        if s.shared_intermediate_size is not None:
            self.shared = SharedExpert(hidden_size, s.shared_intermediate_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        weights, ids = self.route(x)  # [T, K] each
        self.load.add(ids)
        if self.experts is not None:
            out = self.experts(x, weights, ids)  # [T, H]
        else:
            out = fused_moe(x, self.w_gate_up, self.w_down, weights, ids, backend=self.backend)  # [T, H]
        if self.shared is not None:
            out = out + self.shared(x)
        return out

    def quantize_experts(self, experts: nn.Module) -> None:
        """Runs the experts through `experts` (called with x, routing weights and ids) from now on; the
        dense expert weights are freed."""
        self.experts = experts
        del self.w_gate_up, self.w_down

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, K] fp32, expert ids [T, K] int64): softmax in fp32 over every expert, then top-k."""
        probs = F.linear(x, self.gate).float().softmax(dim=-1)  # [T, E]
        weights, ids = probs.topk(self.settings.top_k, dim=-1)
        if self.settings.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


def expert_weights(experts: int, out_features: int, in_features: int, dtype: torch.dtype, transposed: bool,
                   ) -> nn.Parameter:
    """[E, out, in] (F.linear's layout per expert); `transposed`: stored as [E, in, out] in memory.

    NOTE: on CPU an expert multiplies a few rows per step (tokens * K / E), and the matmul over weights laid
    out [in, out] runs about 1.7x faster at those sizes than over [out, in] (kernels/moe_reference.py), so
    the CPU engine keeps them transposed in memory; the loader fills the [E, out, in] view either way.
    """
    if transposed:
        return nn.Parameter(torch.empty(experts, in_features, out_features, dtype=dtype).transpose(1, 2))
    return nn.Parameter(torch.empty(experts, out_features, in_features, dtype=dtype))


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: SwiGLU for every token, scaled by a per-token sigmoid gate."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(2 * intermediate_size, hidden_size, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(hidden_size, intermediate_size, dtype=dtype))
        self.gate = nn.Parameter(torch.empty(1, hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        gate, up = F.linear(x, self.gate_up_proj).chunk(2, dim=-1)  # [T, I] each
        out = F.linear(F.silu(gate) * up, self.down_proj)  # [T, H]
        return torch.sigmoid(F.linear(x, self.gate)) * out
