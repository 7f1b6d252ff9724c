"""The BERT encoder family (BERT, XLM-RoBERTa) for embeddings: bidirectional attention, no KV cache.

Reads top to bottom: settings parsed from config.json, embeddings, attention, MLP, encoder layer, model,
weight loading. The forward pass takes the sequences of one step packed (every token of every sequence,
concatenated, no padding) and returns the last hidden states, one row per token, as transformers'
`BertModel(...).last_hidden_state` (without the pooler). Each sequence is embedded whole: no chunking.

Parameter names follow transformers' (so the checkpoint maps onto them by dropping its `bert.` / `roberta.`
/ `model.` prefix), except that query/key/value live in one fused `qkv` projection (one matmul instead of
three); `PACKED_PARAMS` tells `load_weights` where the checkpoint's separate tensors go. Parameters are
allocated uninitialised; `load_weights` fills every one of them and checks none was missed.

XLM-RoBERTa is BERT with two differences that matter here: its position ids start after its padding id
(position p of a sequence reads row `pad_token_id + 1 + p`), and it has one token type.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from conveyor.engine.models.llama import Embedding, Linear

# checkpoint name fragment -> (our fused parameter fragment, shard index within it)
PACKED_PARAMS: dict[str, tuple[str, int]] = {
    ".attention.self.query.": (".attention.self.qkv.", 0),
    ".attention.self.key.": (".attention.self.qkv.", 1),
    ".attention.self.value.": (".attention.self.qkv.", 2),
}
# *ForMaskedLM and friends nest the encoder under one of these
CHECKPOINT_PREFIXES = ("bert.", "roberta.", "model.")
# Tensors an embedding model does not use: the pooler, the masked-LM heads, buffers old checkpoints saved.
IGNORED_PREFIXES = ("pooler.", "cls.", "lm_head.")
IGNORED_NAMES = ("embeddings.position_ids", "embeddings.token_type_ids")
# Old TF-converted checkpoints name the LayerNorm parameters gamma / beta.
LEGACY_SUFFIXES = {".gamma": ".weight", ".beta": ".bias"}

ROW_CHUNK = 1024  # rows per pass of a layer's token-wise part (see EncoderLayer)
# config.json hidden_act -> the `approximate` argument of F.gelu
GELU_APPROXIMATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "max_position_embeddings")


@dataclass(frozen=True)
class EncoderSettings:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    # The longest sequence the model embeds: the position table's rows after the first position's row.
    max_positions: int
    position_offset: int  # row of position 0 in the position table: 0 for BERT, pad_token_id + 1 for XLM-R
    type_vocab_size: int
    layer_norm_eps: float
    gelu_approximation: str  # "none" (erf) or "tanh"
    dtype: torch.dtype  # of every parameter, and of the computation

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], dtype: torch.dtype, *, position_offset: int) -> EncoderSettings:
        missing = [key for key in REQUIRED_KEYS if key not in cfg]
        if missing:
            raise ValueError(f"config.json: missing key(s) {missing}")
        position_type = cfg.get("position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ValueError(f"config.json: position_embedding_type {position_type!r} is not supported "
                             f"(only 'absolute')")
        act = cfg.get("hidden_act", "gelu")
        if act not in GELU_APPROXIMATIONS:
            raise ValueError(f"config.json: hidden_act {act!r} is not supported; supported: "
                             f"{list(GELU_APPROXIMATIONS)}")
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        if hidden % heads:
            raise ValueError(f"config.json: hidden_size {hidden} is not a multiple of "
                             f"num_attention_heads {heads}")
        max_positions = cfg["max_position_embeddings"] - position_offset
        if max_positions < 1:
            raise ValueError(f"config.json: max_position_embeddings {cfg['max_position_embeddings']} "
                             f"leaves no position after the first {position_offset} row(s)")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            head_dim=hidden // heads,
            max_positions=max_positions,
            position_offset=position_offset,
            type_vocab_size=cfg.get("type_vocab_size", 2),
            layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
            gelu_approximation=GELU_APPROXIMATIONS[act],
            dtype=dtype,
        )


def bert_settings(cfg: dict[str, Any], dtype: torch.dtype) -> EncoderSettings:
    return EncoderSettings.from_hf(cfg, dtype, position_offset=0)


def xlm_roberta_settings(cfg: dict[str, Any], dtype: torch.dtype) -> EncoderSettings:
    # Position ids count from padding_idx + 1 (transformers' create_position_ids_from_input_ids); the
    # padding idx is the config's pad_token_id.
    if "pad_token_id" not in cfg:
        raise ValueError("config.json: missing key(s) ['pad_token_id'] (XLM-RoBERTa's position offset)")
    return EncoderSettings.from_hf(cfg, dtype, position_offset=cfg["pad_token_id"] + 1)


class LayerNorm(nn.Module):
    """nn.LayerNorm without its init (the loader fills weight and bias)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class Embeddings(nn.Module):
    """word + position + token type (always type 0), then LayerNorm."""

    def __init__(self, s: EncoderSettings) -> None:
        super().__init__()
        self.word_embeddings = Embedding(s.vocab_size, s.hidden_size, s.dtype)
        self.position_embeddings = Embedding(s.max_positions + s.position_offset, s.hidden_size, s.dtype)
        self.token_type_embeddings = Embedding(s.type_vocab_size, s.hidden_size, s.dtype)
        self.LayerNorm = LayerNorm(s.hidden_size, s.layer_norm_eps, s.dtype)
        self.position_offset = s.position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T], [T] -> [T, H]
        x = self.word_embeddings(input_ids)  # [T, H], a fresh tensor: add in place
        x += self.position_embeddings(positions + self.position_offset)
        x += self.token_type_embeddings.weight[0]  # [H], broadcast: every token is of type 0
        return self.LayerNorm(x)


@dataclass(frozen=True)
class PackedLayout:
    """Where each sequence lies in the packed rows: computed once per forward, used by every layer."""

    bounds: list[tuple[int, int]]  # (start, end) row of each sequence
    row_chunks: list[slice]  # the rows in runs of at most ROW_CHUNK, for the token-wise part of a layer

    @classmethod
    def from_starts(cls, query_start_loc: torch.Tensor) -> PackedLayout:  # [S + 1] cumulative lengths
        starts = query_start_loc.tolist()  # one host sync per forward (none on CPU)
        num_tokens = starts[-1]
        chunk_starts = range(0, num_tokens, ROW_CHUNK)
        return cls(bounds=list(pairwise(starts)),
                   row_chunks=[slice(r, min(r + ROW_CHUNK, num_tokens)) for r in chunk_starts])


class SelfAttention(nn.Module):
    """Bidirectional attention within each sequence of the packed rows.

    NOTE: one SDPA call per sequence, on 4-d views of the fused projection: no padding, no mask, no copy
    in. Measured on this project's CPU (AMD EPYC, AVX2, fp32, hidden 384, 12 heads, 64 sequences of 16-512
    tokens; best of 5, interleaved): padding the batch to [S, Lmax] with a key padding mask took 4.1x as
    long at 1 thread (4.3x at 2): it computes ~3x the scores, plus the scatter/gather; sorting into 8 or 16
    length buckets padded each 1.5-1.7x; 3-d [Hn, L, D] inputs fall off the CPU flash kernel to the math
    path, ~3x. With 512 short sequences (8-64 tokens) the loop still won: padded 2.8x, buckets 1.3-1.4x.
    """

    def __init__(self, s: EncoderSettings) -> None:
        super().__init__()
        self.num_heads, self.head_dim = s.num_heads, s.head_dim
        self.qkv = Linear(s.hidden_size, 3 * s.hidden_size, True, s.dtype)
        self.scale = 1.0 / math.sqrt(s.head_dim)

    def forward(self, x: torch.Tensor, layout: PackedLayout, qkv: torch.Tensor, out: torch.Tensor) -> None:
        """x [T, H] -> out [T, H] (the heads' outputs side by side); qkv [T, 3H] is scratch space."""
        if isinstance(self.qkv, Linear):
            torch.addmm(self.qkv.bias, x, self.qkv.weight.t(), out=qkv)
        else:  # quantized (engine/quantization.py): its own product
            qkv.copy_(self.qkv(x))
        # [T, 3, Hn, D] -> [3, 1, Hn, T, D]: views, no copy
        q, k, v = qkv.view(-1, 3, self.num_heads, self.head_dim).permute(1, 2, 0, 3)[:, None].unbind(0)
        heads = out.view(-1, self.num_heads, self.head_dim)  # [T, Hn, D]
        for start, end in layout.bounds:
            # 4-d inputs: torch's CPU flash kernel takes them (3-d ones fall back to the slower math path)
            seq = F.scaled_dot_product_attention(q[..., start:end, :], k[..., start:end, :],
                                                 v[..., start:end, :], scale=self.scale)  # [1, Hn, L, D]
            heads[start:end] = seq[0].transpose(0, 1)


class Attention(nn.Module):
    """transformers' BertAttention, kept as a container for its parameter names: self-attention, then
    `output` (projection, residual, LayerNorm), which EncoderLayer runs chunk by chunk."""

    def __init__(self, s: EncoderSettings) -> None:
        super().__init__()
        self.self = SelfAttention(s)
        self.output = DenseResidualNorm(s.hidden_size, s.hidden_size, s)


class DenseResidualNorm(nn.Module):
    """LayerNorm(dense(x) + residual): transformers' BertSelfOutput and BertOutput (dropout is a no-op)."""

    def __init__(self, in_features: int, out_features: int, s: EncoderSettings) -> None:
        super().__init__()
        self.dense = Linear(in_features, out_features, True, s.dtype)
        self.LayerNorm = LayerNorm(out_features, s.layer_norm_eps, s.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:  # [R, in], [R, out]
        y = self.dense(x)  # a fresh tensor: add in place
        y += residual
        return self.LayerNorm(y)


class Intermediate(nn.Module):
    """gelu(dense(x)): the MLP's up projection."""

    def __init__(self, s: EncoderSettings) -> None:
        super().__init__()
        self.dense = Linear(s.hidden_size, s.intermediate_size, True, s.dtype)
        self.approximate = s.gelu_approximation

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [R, H] -> [R, I]
        return F.gelu(self.dense(x), approximate=self.approximate)


class EncoderLayer(nn.Module):
    """Attention over whole sequences, then the token-wise rest (output projection, LayerNorms, MLP) in
    chunks of ROW_CHUNK rows.

    NOTE: by chunks, the [R, I] MLP activations stay in the CPU caches and are small enough for malloc to
    reuse (a [T, I] one is a fresh mmap, page-faulted in, every layer): with 1024-row chunks the token-wise
    part took 0.80x as long as over all 15.6 k rows at once (1 thread; 512- and 2048-row chunks the same,
    4096 0.89x).
    """

    def __init__(self, s: EncoderSettings) -> None:
        super().__init__()
        self.attention = Attention(s)
        self.intermediate = Intermediate(s)
        self.output = DenseResidualNorm(s.intermediate_size, s.hidden_size, s)

    def forward(self, x: torch.Tensor, layout: PackedLayout, qkv: torch.Tensor, context: torch.Tensor
                ) -> None:
        """x [T, H] in place; qkv [T, 3H] and context [T, H] are scratch space."""
        self.attention.self(x, layout, qkv, context)
        for rows in layout.row_chunks:
            h = self.attention.output(context[rows], x[rows])  # [R, H]
            x[rows] = self.output(self.intermediate(h), h)


class Encoder(nn.Module):
    def __init__(self, s: EncoderSettings) -> None:
        super().__init__()
        self.layer = nn.ModuleList(EncoderLayer(s) for _ in range(s.num_layers))

    def forward(self, x: torch.Tensor, layout: PackedLayout) -> torch.Tensor:  # [T, H], updated in place
        # Scratch space every layer reuses, allocated (and paged in) once per forward.
        qkv = x.new_empty(x.shape[0], 3 * x.shape[1])  # [T, 3H]
        context = torch.empty_like(x)  # [T, H]
        for layer in self.layer:
            layer(x, layout, qkv, context)
        return x


class BertEncoder(nn.Module):
    """BertModel / XLMRobertaModel without the pooler, over packed sequences."""

    is_encoder: bool = True  # the loader and the runner dispatch on it: no KV cache, no logits

    def __init__(self, s: EncoderSettings) -> None:
        super().__init__()
        self.settings = s
        self.embeddings = Embeddings(s)
        self.encoder = Encoder(s)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor,
                max_seq_len: int) -> torch.Tensor:
        """input_ids [T] and positions [T] (0-based within each sequence) of the sequences concatenated,
        query_start_loc [S + 1] their cumulative lengths -> last hidden states [T, H].

        max_seq_len (the longest sequence) is part of the runner's contract; the per-sequence attention
        needs only the bounds.
        """
        del max_seq_len
        layout = PackedLayout.from_starts(query_start_loc)
        return self.encoder(self.embeddings(input_ids, positions), layout)

    @torch.no_grad()
    def load_weights(self, files: list[Path]) -> None:
        """Fill every parameter from the safetensors files; ValueError naming the missing, unexpected or
        mis-shaped tensors."""
        load_encoder_weights(self, files)

    def packed_shard_sizes(self) -> dict[str, list[int]]:
        """Rows of each checkpoint tensor inside our fused parameters, in PACKED_PARAMS shard order."""
        h = self.settings.hidden_size
        return {".attention.self.qkv.": [h, h, h]}


def load_encoder_weights(model: BertEncoder, files: list[Path]) -> None:
    params = dict(model.named_parameters())
    shard_sizes = model.packed_shard_sizes()
    expected = {(name, shard) for name in params for shard in range(len(shard_sizes.get(_fused(name), [0])))}
    loaded: set[tuple[str, int]] = set()
    unexpected: list[str] = []
    for ckpt_name, file in _checkpoint_tensors(files):
        name, shard = _our_name(ckpt_name)
        if name is None:
            continue
        if name not in params:
            unexpected.append(ckpt_name)
            continue
        _copy_into(params[name], shard, shard_sizes.get(_fused(name)), file.get_tensor(ckpt_name), ckpt_name)
        loaded.add((name, shard))
    missing = sorted(f"{name}[{shard}]" if _fused(name) else name for name, shard in expected - loaded)
    if missing or unexpected:
        raise ValueError(
            f"model weights: missing {missing or 'none'}; unexpected {sorted(unexpected) or 'none'}")


def _checkpoint_tensors(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """(tensor name, its open safetensors file) for every tensor of every file; a tensor is read only when
    asked for (`get_tensor`), while the file is open."""
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for ckpt_name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield ckpt_name, f


def _our_name(ckpt_name: str) -> tuple[str | None, int]:
    """Checkpoint tensor name -> (our parameter name or None when the tensor is ignored, shard index inside a
    fused parameter, else 0)."""
    name = next((ckpt_name[len(p):] for p in CHECKPOINT_PREFIXES if ckpt_name.startswith(p)), ckpt_name)
    if name.startswith(IGNORED_PREFIXES) or name in IGNORED_NAMES:
        return None, 0
    for old, new in LEGACY_SUFFIXES.items():
        if name.endswith(old) and ".LayerNorm" in name:
            name = name[: -len(old)] + new
    for part, (fused, shard) in PACKED_PARAMS.items():
        if part in name:
            return name.replace(part, fused), shard
    return name, 0


def _fused(name: str) -> str | None:
    """The fused fragment (".attention.self.qkv.") of a fused parameter's name, else None."""
    return next((fused for fused, _ in PACKED_PARAMS.values() if fused in name), None)


def _copy_into(
    param: torch.Tensor, shard: int, sizes: list[int] | None, tensor: torch.Tensor, ckpt_name: str
) -> None:
    target = param if sizes is None else param.narrow(0, sum(sizes[:shard]), sizes[shard])
    if target.shape != tensor.shape:
        raise ValueError(f"model weights: {ckpt_name} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(target.shape)}")
    target.copy_(tensor)
