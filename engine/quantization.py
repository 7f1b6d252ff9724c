"""Weight-only quantization of a loaded model: its projections' weights replaced by int8 or int4 groups
(kernels/quant_reference.py has the layouts), multiplied by the backend's kernel (kernels/quant_linear.py).

`EngineConfig.quantization`:
- "int8": every projection (attention, MLP, experts, the LM head) and the token embedding int8, a scale per
  32 weights;
- "int4": the projections int4 (a scale and an offset per 32); the LM head and the embedding int8, as 4-bit
  GGUF files usually keep them (SmolLM2's Q4_1 file: its embedding, tied to the head, is Q8_0);
- "none": the model's dtype, as loaded;
- "auto": a GGUF file's own (checkpoints/gguf_file.py gguf_quantization: its most common tensor type), else
  "none".

Applied after loading (online, from any checkpoint): the fp32 weights are replaced one at a time and freed.
A GGUF file's Q4_1 and Q8_0 tensors come back exactly (their blocks are these groups); other types are
requantized. Biases, norms and routers stay in the model's dtype; LoRA adapters add their products to the
quantized projections' outputs as to any other (engine/lora/batch.py). Projections whose width is not a
multiple of 32 stay unquantized. Mixture-of-experts layers quantize their experts (QuantizedExperts); their
routers and a Qwen2-MoE shared expert stay in the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.checkpoints.gguf_file import gguf_quantization
from conveyor.engine.models.llama import Embedding, Linear
from conveyor.engine.models.moe import SparseMoE
from conveyor.kernels.moe_reference import sort_by_expert
from conveyor.kernels.quant_linear import quant_linear
from conveyor.kernels.quant_reference import GROUP_SIZE, QuantizedTensor, dequantize, quantize

PROJECTION_BITS = {"int8": 8, "int4": 4}
HEAD_BITS = 8  # the LM head and the token embedding, under either method


class QuantizedLinear(nn.Module):
    """F.linear over a quantized weight [N, K] (+ the layer's bias, kept in the model's dtype)."""

    def __init__(self, t: QuantizedTensor, bias: torch.Tensor | None, backend: str) -> None:
        super().__init__()
        self.register_buffer("q", t.q)
        self.register_buffer("scales", t.scales)
        self.register_buffer("mins", t.mins)
        self.bits, self.backend = t.bits, backend
        self.bias = bias

    def tensor(self) -> QuantizedTensor:
        return QuantizedTensor(self.q, self.scales, self.mins, self.bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        return quant_linear(x, self.tensor(), self.bias, self.backend)


class QuantizedEmbedding(nn.Module):
    """Token embedding rows read from a quantized table [V, H]: a tied LM head's own tensors (registered in
    both modules; counted once, as a tied parameter is)."""

    def __init__(self, t: QuantizedTensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("q", t.q)
        self.register_buffer("scales", t.scales)
        self.register_buffer("mins", t.mins)
        self.bits, self.dtype = t.bits, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        rows = QuantizedTensor(self.q, self.scales, self.mins, self.bits).rows(ids)
        return dequantize(rows).to(self.dtype)


class QuantizedExperts(nn.Module):
    """A mixture-of-experts layer's experts, quantized: kernels/moe_reference.py's grouped computation (the
    (token, k) pairs sorted by expert, each expert's rows in one product, one weighted scatter back), each
    product a quantized linear. Routing stays the layer's own (engine/models/moe.py)."""

    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor, bits: int, backend: str) -> None:
        super().__init__()  # w_gate_up [E, 2I, H], w_down [E, H, I]
        self.gate_up = nn.ModuleList(QuantizedLinear(quantize(w, bits), None, backend) for w in w_gate_up)
        self.down = nn.ModuleList(QuantizedLinear(quantize(w, bits), None, backend) for w in w_down)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_weights and topk_ids [T, K] -> [T, H] in x's dtype (kernels/moe.py's contract)."""
        order, counts = sort_by_expert(topk_ids, len(self.down))  # [T*K], [E]
        tokens = order // topk_ids.shape[1]  # [T*K]: the token of each sorted pair
        weights = topk_weights.reshape(-1)[order].float()  # [T*K]
        rows = x.index_select(0, tokens)  # [T*K, H] in expert order
        expert_out = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts.tolist()):
            if count:
                gate, up = self.gate_up[expert](rows[start:start + count]).chunk(2, dim=-1)  # [n, I] each
                expert_out[start:start + count] = self.down[expert](F.silu(gate) * up)
                start += count
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        return out.index_add_(0, tokens, expert_out.float() * weights[:, None]).to(x.dtype)


@dataclass(frozen=True)
class QuantizationReport:
    method: str  # "int8" or "int4"
    quantized: int  # projections (and MoE layers' experts) replaced
    kept: list[str]  # those left in the model's dtype (an input width not a multiple of 32)


def resolve_quantization(method: str, model_dir: str | Path) -> str:
    """"auto" -> the quantization of the GGUF file the folder was converted from, else "none"."""
    if method != "auto":
        return method
    return gguf_quantization(Path(model_dir)) or "none"


def quantize_model(model: nn.Module, method: str, backend: str) -> QuantizationReport:
    """Replaces every projection (every `Linear` of engine/models/llama.py: attention, MLP, LM head) and the
    token embedding of a loaded model by its quantized form, in place. backend: kernels/quant_linear.py's."""
    bits = PROJECTION_BITS[method]
    dtype = next(model.parameters()).dtype
    embeddings = [(name, m) for name, m in model.named_modules() if isinstance(m, Embedding)]
    tied = {id(m.weight): name for name, m in embeddings}
    quantized, kept = 0, []
    heads: dict[str, QuantizedLinear] = {}  # a tied embedding's name -> its LM head's replacement
    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear):
            continue
        if module.weight.shape[1] % GROUP_SIZE:
            kept.append(name)
            continue
        is_head = name == "lm_head"
        replacement = QuantizedLinear(quantize(module.weight.detach(), HEAD_BITS if is_head else bits),
                                      module.bias, backend)
        if id(module.weight) in tied:
            heads[tied[id(module.weight)]] = replacement
        _replace(model, name, replacement)
        quantized += 1
    for name, module in list(model.named_modules()):
        if not isinstance(module, SparseMoE) or module.experts is not None:
            continue
        if module.w_gate_up.shape[2] % GROUP_SIZE or module.w_down.shape[2] % GROUP_SIZE:
            kept.append(f"{name} experts")
            continue
        module.quantize_experts(QuantizedExperts(module.w_gate_up.detach(), module.w_down.detach(), bits,
                                                 backend))
        quantized += 1
    for name, embedding in embeddings:
        if name.endswith("embed_tokens"):
            head = heads.get(name)
            table = head.tensor() if head is not None else quantize(embedding.weight.detach(), HEAD_BITS)
            _replace(model, name, QuantizedEmbedding(table, dtype))
    return QuantizationReport(method, quantized, kept)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as they are held: parameters and quantized buffers, each tensor once."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)
