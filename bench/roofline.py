"""How close the engine gets to the machine: model FLOPs done per second against the FLOP/s `torch.mm`
reaches at the step's own shapes, measured in the same run.

Model FLOPs of a request whose prompt has P tokens and which generated O tokens: the T = P + O - 1 tokens
that went through the model cost 2 x (per-layer linear parameters x layers) each, attention costs
4 x layers x Hq x D x (p + 1) for the token at position p (QK^T and AV), and the LM head runs once per
generated token (2 x H x V). Recomputation after a preemption is not useful work and is not counted, so
every system is credited with the same FLOPs for the same requests.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from conveyor.bench.records import RequestRecord, StepSample


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # of the MLP; of each expert in a mixture of experts
    vocab: int
    num_experts: int = 1  # a dense MLP is one expert that every token uses
    experts_per_token: int = 1

    @classmethod
    def from_config(cls, model_path: str | Path) -> ModelShape:
        c = json.loads((Path(model_path) / "config.json").read_text())
        heads = c["num_attention_heads"]
        experts = c.get("num_local_experts") or c.get("num_experts") or 1
        return cls(
            hidden=c["hidden_size"],
            layers=c["num_hidden_layers"],
            heads=heads,
            kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            intermediate=(c.get("moe_intermediate_size") or c["intermediate_size"]) if experts > 1
            else c["intermediate_size"],
            vocab=c["vocab_size"],
            num_experts=experts,
            experts_per_token=(c.get("num_experts_per_tok") or 1) if experts > 1 else 1,
        )

    @property
    def layer_linear_params(self) -> int:
        """The linear weights one token goes through in a layer: attention and its experts' MLPs."""
        h, d = self.hidden, self.head_dim
        attn = h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h
        return attn + 3 * h * self.intermediate * self.experts_per_token

    @property
    def num_params(self) -> int:
        """Linear weights of all layers (every expert), plus the embedding and the LM head (untied count)."""
        idle_experts = 3 * self.hidden * self.intermediate * (self.num_experts - self.experts_per_token)
        return self.layers * (self.layer_linear_params + idle_experts) + 2 * self.vocab * self.hidden

    def linear_shapes(self, tokens: int, sampled: int) -> list[tuple[int, int, int]]:
        """(M, K, N) of every matmul in one step: per layer qkv, o, gate_up, down; then the LM head."""
        h, d = self.hidden, self.head_dim
        per_layer = [
            (tokens, h, (self.heads + 2 * self.kv_heads) * d),
            (tokens, self.heads * d, h),
            # An MoE layer's experts multiply tokens x experts_per_token rows in all (split among experts).
            (tokens * self.experts_per_token, h, 2 * self.intermediate),
            (tokens * self.experts_per_token, self.intermediate, h),
        ]
        return per_layer * self.layers + [(max(sampled, 1), h, self.vocab)]


def request_flops(shape: ModelShape, prompt_tokens: int, output_tokens: int) -> float:
    t = prompt_tokens + max(output_tokens, 1) - 1
    linear = 2.0 * shape.layers * shape.layer_linear_params * t
    attention = 4.0 * shape.layers * shape.heads * shape.head_dim * t * (t + 1) / 2
    head = 2.0 * shape.hidden * shape.vocab * output_tokens
    return linear + attention + head


def model_flops(shape: ModelShape, records: list[RequestRecord]) -> float:
    """FLOPs of the work every request got done (completed, and cancelled up to where it stopped)."""
    return sum(request_flops(shape, r.prompt_tokens, r.output_tokens) for r in records if r.output_tokens > 0)


@dataclass(frozen=True)
class MatmulBound:
    """torch.mm FLOP/s at the run's own step shapes.

    Steps are bucketed by tokens per step (rounded up to a power of two); each bucket's matmuls are timed
    once. `flops_per_s` is the rate the whole run would reach if every step's linear work ran at torch.mm
    speed for its bucket: sum of step FLOPs / sum of (step FLOPs / bucket rate).
    """

    flops_per_s: float
    buckets: list[dict[str, float]]  # tokens, sampled, steps, flops_per_s

    def asdict(self) -> dict[str, Any]:
        return asdict(self)


def step_linear_flops(shape: ModelShape, tokens: int, sampled: int) -> float:
    return sum(2.0 * m * k * n for m, k, n in shape.linear_shapes(tokens, sampled))


@torch.inference_mode()
def matmul_bound(
    shape: ModelShape,
    samples: list[StepSample],
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seconds_per_bucket: float = 0.3,
) -> MatmulBound | None:
    steps = [s for s in samples if s.num_tokens > 0]
    if not steps:
        return None
    buckets: dict[int, list[StepSample]] = {}
    for s in steps:
        buckets.setdefault(1 << (s.num_tokens - 1).bit_length(), []).append(s)
    rates, rows = {}, []
    for tokens, members in sorted(buckets.items()):
        sampled = max(1, sorted(m.num_seqs for m in members)[len(members) // 2])
        rates[tokens] = _shape_rate(shape, tokens, sampled, dtype, device, seconds_per_bucket)
        rows.append(
            {"tokens": tokens, "sampled": sampled, "steps": len(members), "flops_per_s": rates[tokens]}
        )
    flops = [step_linear_flops(shape, s.num_tokens, s.num_seqs) for s in steps]
    ideal_s = sum(f / rates[1 << (s.num_tokens - 1).bit_length()] for f, s in zip(flops, steps, strict=True))
    return MatmulBound(flops_per_s=sum(flops) / ideal_s, buckets=rows)


def _shape_rate(
    shape: ModelShape, tokens: int, sampled: int, dtype: torch.dtype, device: str, budget_s: float
) -> float:
    """torch.mm FLOP/s over one step's matmuls (each distinct shape timed, weighted by its count)."""
    shapes = shape.linear_shapes(tokens, sampled)
    distinct = {s: shapes.count(s) for s in shapes}
    flops, seconds = 0.0, 0.0
    for (m, k, n), count in distinct.items():
        per_call = _time_mm(m, k, n, dtype, device, budget_s / len(distinct))
        flops += 2.0 * m * k * n * count
        seconds += per_call * count
    return flops / seconds


def _time_mm(m: int, k: int, n: int, dtype: torch.dtype, device: str, budget_s: float) -> float:
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    for _ in range(2):
        torch.mm(a, b)
    _sync(device)
    calls, begin = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        calls += 1
        if calls % 4 == 0:
            _sync(device)
            elapsed = time.perf_counter() - begin
            if elapsed >= budget_s:
                return elapsed / calls


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def efficiency(
    shape: ModelShape,
    records: list[RequestRecord],
    samples: list[StepSample],
    duration_s: float,
    bound: MatmulBound | None,
) -> dict[str, Any]:
    """Model FLOP/s, share of the matmul bound, and engine overhead at batch >= 32."""
    flops = model_flops(shape, records)
    busy_s = sum(s.step_s for s in samples) or duration_s
    out: dict[str, Any] = {
        "model_params": shape.num_params,
        "model_flops": flops,
        "model_flops_per_s": flops / busy_s,
        "model_flops_per_s_wall": flops / duration_s,
        "busy_s": busy_s,
    }
    if bound is not None:
        out["matmul_bound"] = bound.asdict()
        out["share_of_matmul_bound"] = out["model_flops_per_s"] / bound.flops_per_s
    out.update(overhead(samples, min_batch=32))
    return out


def overhead(samples: list[StepSample], min_batch: int) -> dict[str, Any]:
    """(step wall time - forward time) / step wall time, over the steps with at least min_batch sequences."""
    big = [s for s in samples if s.num_seqs >= min_batch and s.forward_s is not None]
    step = sum(s.step_s for s in big)
    forward = sum(s.forward_s or 0.0 for s in big)
    every_step = sum(s.step_s for s in samples)
    every_forward = sum(s.forward_s or 0.0 for s in samples)
    return {
        "overhead_min_batch": min_batch,
        "overhead_steps": len(big),
        "overhead_share": (step - forward) / step if step > 0 else None,
        "overhead_share_all_steps": (every_step - every_forward) / every_step if every_step > 0 else None,
    }
