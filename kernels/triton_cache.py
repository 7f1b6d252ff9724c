"""Triton cache write: one program per new token copies its [Hkv, D] key and value rows to their slot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conveyor.kernels.checks import check_reshape_and_cache


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kct, stride_kch, stride_kcd,
    stride_vcb, stride_vct, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, HEADS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_P2)[:, None]
    dims = tl.arange(0, HEAD_DIM_P2)[None, :]
    # [Hkv, D]; slot < 0 writes nothing (the slot is broadcast first: the interpreter rejects scalar masks)
    mask = ((heads * 0 + dims * 0 + slot) >= 0) & (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask, other=0.0)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kct + heads * stride_kch + dims * stride_kcd
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask, other=0.0)
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vct + heads * stride_vch + dims * stride_vcd
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as `kernels.reshape_and_cache`. Slots must lie below num_blocks * block_size."""
    check_reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
    if k.device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise ValueError(f"k is on {k.device}: the Triton backend needs CUDA tensors, or TRITON_INTERPRET=1 "
                         "set before triton is imported to run on the CPU")
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping.contiguous(),
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEADS_P2=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_P2=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1],
    )
