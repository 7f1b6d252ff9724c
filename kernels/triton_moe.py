"""Triton mixture-of-experts expert computation: a grouped GEMM over the step's (token, k) pairs sorted by
expert, every expert of the step in one launch of each of two kernels.

Same contract as `conveyor.kernels.moe_reference.fused_moe_ref` (x [T, H], w_gate_up [E, 2I, H], w_down [E,
H, I], topk_weights / topk_ids [T, K] -> out [T, H] in x's dtype).

Host side (torch ops, no loop over tokens, no host sync): the P = T * K pairs `t * K + k` are sorted by
expert and each expert's segment is padded to a multiple of BLOCK_M, so that every tile of BLOCK_M sorted
rows belongs to one expert:

- `sorted_pairs` [num_tiles * BLOCK_M] int32: the pair of each sorted row, P on a padding row (invalid);
- `tile_experts` [num_tiles] int32: the expert of each tile, -1 for tiles past the last segment.

num_tiles is the bound cdiv(P + min(P, E) * (BLOCK_M - 1), BLOCK_M), known from the shapes alone; the tiles
past the last segment exit at once.

- gate_up: grid (tile, I / BLOCK_N): g, u [BLOCK_M, BLOCK_N] fp32 = x[tokens] @ w_gate_up[e, cols].T and
  x[tokens] @ w_gate_up[e, I + cols].T, over H in BLOCK_K steps (both column blocks in one program, so the
  epilogue writes h = silu(g) * u, [padded rows, I] in x's dtype, once);
- down: grid (tile, H / BLOCK_N): y = h[rows] @ w_down[e, cols].T * topk_weights[pair], fp32, written per
  pair into [P, H]; the host sums over K (deterministic, no atomics) and casts to x's dtype.

Every load and store is masked, so any H and I work. fp32 accumulation; fp32 inputs use IEEE dots, fp16 and
bf16 the tensor cores (bf16 under TRITON_INTERPRET=1 is upcast to fp32 first: the interpreter's tl.dot
cannot take bf16). The expert ids are trusted (the reference checks their values): an id outside
[0, E) is the caller's bug.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from conveyor.kernels.moe_reference import check_fused_moe, sort_by_expert

BLOCK_N = 64
BLOCK_K = 64
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

__all__ = ["BLOCK_K", "BLOCK_N", "MoeBlocks", "align_by_expert", "choose_blocks", "fused_moe_triton"]


@dataclass(frozen=True)
class MoeBlocks:
    """Tile sizes (powers of 2, >= 16): BLOCK_M sorted rows, BLOCK_N output columns, BLOCK_K reduction."""

    block_m: int
    block_n: int = BLOCK_N
    block_k: int = BLOCK_K


def choose_blocks(num_pairs: int, num_experts: int) -> MoeBlocks:
    """BLOCK_M by the mean rows per expert: 16 for decode steps (less padding), up to 64 for prefills."""
    rows_per_expert = num_pairs / num_experts
    block_m = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 64 else 64
    return MoeBlocks(block_m)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # bf16 under the interpreter, whose tl.dot multiplies bf16 bit patterns (triton issue 11584)
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee") if IEEE else tl.dot(a, b, acc)


@triton.jit
def _tile_rows(pairs_ptr, tile, num_rows, num_pairs, BLOCK_M: tl.constexpr):
    """The tile's sorted row offsets [BLOCK_M] int64, their pairs, and which rows are real (not padding)."""
    offs_m = tile.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m, mask=offs_m < num_rows, other=num_pairs).to(tl.int64)
    return offs_m, pairs, pairs < num_pairs


@triton.jit
def _moe_gate_up(x_ptr, w_ptr, h_ptr, pairs_ptr, tile_experts_ptr, num_rows, num_pairs, top_k, hidden, inter,
                 stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_hm,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                 UPCAST: tl.constexpr):
    tile, col_tile = tl.program_id(0), tl.program_id(1)
    expert = tl.load(tile_experts_ptr + tile)
    if expert >= 0:
        offs_m, pairs, row_ok = _tile_rows(pairs_ptr, tile, num_rows, num_pairs, BLOCK_M)
        tokens = pairs // top_k  # [BLOCK_M]
        offs_n = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < inter
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < hidden
            x = tl.load(x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xh,
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            w_mask = k_ok[:, None] & n_ok[None, :]
            w_gate = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wh,
                             mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]: the gate rows, transposed
            w_up = tl.load(w_base + (inter + offs_n)[None, :] * stride_wn + offs_k[:, None] * stride_wh,
                           mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]: the up rows, transposed
            gate = _dot(x, w_gate, gate, IEEE, UPCAST)
            up = _dot(x, w_up, up, IEEE, UPCAST)
        h = gate * tl.sigmoid(gate) * up  # silu(gate) * up, fp32
        tl.store(h_ptr + offs_m[:, None] * stride_hm + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_down(h_ptr, w_ptr, out_ptr, pairs_ptr, tile_experts_ptr, weights_ptr, num_rows, num_pairs,
              hidden, inter, stride_hm, stride_we, stride_wn, stride_wi, stride_om,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
              UPCAST: tl.constexpr):
    tile, col_tile = tl.program_id(0), tl.program_id(1)
    expert = tl.load(tile_experts_ptr + tile)
    if expert >= 0:
        offs_m, pairs, row_ok = _tile_rows(pairs_ptr, tile, num_rows, num_pairs, BLOCK_M)
        offs_n = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hidden
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < inter
            h = tl.load(h_ptr + offs_m[:, None] * stride_hm + offs_k[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wi,
                        mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]: w_down[e].T
            acc = _dot(h, w, acc, IEEE, UPCAST)
        routing = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)  # [BLOCK_M]
        tl.store(out_ptr + pairs[:, None] * stride_om + offs_n[None, :], acc * routing[:, None],
                 mask=row_ok[:, None] & n_ok[None, :])


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [num_tiles * block_m] int32, tile_experts [num_tiles] int32): see the module docstring.

    Torch ops only, without a host sync: the sizes follow from the shapes."""
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    order, counts = sort_by_expert(topk_ids, num_experts)  # [P], [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]: each segment rounded up to whole tiles
    padded_ends = padded.cumsum(0)  # [E]
    starts = counts.cumsum(0) - counts  # [E]: each segment's first row, unpadded
    sorted_experts = topk_ids.reshape(-1).long()[order]  # [P]
    rank = torch.arange(num_pairs, device=device) - starts[sorted_experts]  # [P]: row within its segment
    dest = padded_ends[sorted_experts] - padded[sorted_experts] + rank  # [P]: row in the padded layout
    num_tiles = triton.cdiv(num_pairs + min(num_pairs, num_experts) * (block_m - 1), block_m)
    sorted_pairs = torch.full((num_tiles * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.to(torch.int32)
    tile_starts = torch.arange(num_tiles, device=device) * block_m  # [num_tiles]
    tile_experts = torch.searchsorted(padded_ends, tile_starts, right=True)  # [num_tiles]: first end > start
    tile_experts = torch.where(tile_experts < num_experts, tile_experts, -1).to(torch.int32)
    return sorted_pairs, tile_experts


def fused_moe_triton(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    blocks: MoeBlocks | None = None,
) -> torch.Tensor:
    """out [T, H] in x's dtype (see the module docstring); `blocks` overrides `choose_blocks`."""
    _check_triton_inputs(x, w_gate_up, w_down, topk_weights, topk_ids)
    num_tokens, hidden = x.shape
    num_experts, inter, top_k = w_down.shape[0], w_down.shape[2], topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    blocks = blocks or choose_blocks(num_pairs, num_experts)
    _check_blocks(blocks)
    sorted_pairs, tile_experts = align_by_expert(topk_ids, num_experts, blocks.block_m)
    h = _gate_up(x, w_gate_up, sorted_pairs, tile_experts, num_pairs, top_k, inter, blocks)
    per_pair = _down(h, w_down, sorted_pairs, tile_experts, topk_weights.reshape(-1).contiguous(), hidden,
                     blocks)
    return per_pair.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)  # [T, H]: fp32 sum over K


def _gate_up(x: torch.Tensor, w_gate_up: torch.Tensor, sorted_pairs: torch.Tensor, tile_experts: torch.Tensor,
             num_pairs: int, top_k: int, inter: int, blocks: MoeBlocks) -> torch.Tensor:
    """h [padded rows, I] in x's dtype: silu(gate) * up of every sorted row (padding rows left unwritten)."""
    h = torch.empty(sorted_pairs.shape[0], inter, dtype=x.dtype, device=x.device)
    grid = (tile_experts.shape[0], triton.cdiv(inter, blocks.block_n))
    _moe_gate_up[grid](
        x, w_gate_up, h, sorted_pairs, tile_experts, sorted_pairs.shape[0], num_pairs, top_k, x.shape[1],
        inter, x.stride(0), x.stride(1), *w_gate_up.stride(), h.stride(0),
        BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, BLOCK_K=blocks.block_k, **_dot_mode(x.dtype))
    return h


def _down(h: torch.Tensor, w_down: torch.Tensor, sorted_pairs: torch.Tensor, tile_experts: torch.Tensor,
          weights: torch.Tensor, hidden: int, blocks: MoeBlocks) -> torch.Tensor:
    """[P, H] fp32: each pair's expert output scaled by its routing weight (`weights` [P])."""
    num_pairs = weights.shape[0]
    out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=h.device)
    grid = (tile_experts.shape[0], triton.cdiv(hidden, blocks.block_n))
    _moe_down[grid](
        h, w_down, out, sorted_pairs, tile_experts, weights, sorted_pairs.shape[0], num_pairs, hidden,
        h.shape[1], h.stride(0), *w_down.stride(), out.stride(0),
        BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, BLOCK_K=blocks.block_k, **_dot_mode(h.dtype))
    return out


def _dot_mode(dtype: torch.dtype) -> dict[str, bool]:
    """IEEE fp32 dots for fp32 inputs (and bf16 under the interpreter, upcast first); else tensor cores."""
    upcast = dtype == torch.bfloat16 and bool(triton.knobs.runtime.interpret)
    return {"IEEE": dtype == torch.float32 or upcast, "UPCAST": upcast}


def _check_triton_inputs(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
    check_fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids)
    if x.dtype not in TRITON_DTYPES:
        raise ValueError(f"x dtype must be one of {TRITON_DTYPES} for the Triton kernels, got {x.dtype}")
    if x.device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise ValueError(f"x is on {x.device}: the Triton backend needs CUDA tensors, or TRITON_INTERPRET=1 "
                         "set before triton is imported to run on the CPU")


def _check_blocks(blocks: MoeBlocks) -> None:
    for name in ("block_m", "block_n", "block_k"):
        size = getattr(blocks, name)
        if size < 16 or size & (size - 1):
            raise ValueError(f"blocks.{name} must be a power of 2 >= 16, got {size}")
