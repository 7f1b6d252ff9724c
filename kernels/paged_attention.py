"""Paged attention and KV-cache writes for the engine: Triton kernels on CUDA, C++ kernels on CPU.

Contract (every backend, same signatures):

- `AttentionMetadata` (kernels/metadata.py): one step's metadata, S sequences and T query tokens, built once
  per step by its caller and passed to every layer's calls:
  - `slot_mapping` [T]: `block_id * block_size + offset` of each new token, read only by the cache write.
  - `block_tables` [S, max_blocks], `seq_lens` [S], `query_start_loc` [S + 1]: int32 (int64 accepted), on
    q's device. `seq_lens[s]` counts the cached tokens of sequence s including this step's (already written
    by `reshape_and_cache`). Block-table entries past a sequence's last block are ignored, and so are those
    of blocks wholly before its window (every key in them older than the window of the step's first query of
    the sequence, with `window` given): the engine may free such blocks early, so they may be -1 or stale.
    No backend reads them: the Triton and C++ kernels start their key loops in the window's first block, the
    reference gathers from it on (a backend that gathered them would have to clamp and mask them).
  - `max_query_len`, `max_seq_len`: Python ints, upper bounds of the query lengths and `seq_lens`.
  - `plan`: the step's `AttentionPlan` from `plan_paged_attention`, or None (the default).
- `paged_attention(q, k_cache, v_cache, meta, scale, out=None, *, window=None, softcap=None, backend=None)
  -> out`
  - `q` [T, Hq, D]: every query token of the step, sequences concatenated in `meta.query_start_loc` order.
  - `k_cache`, `v_cache` [num_blocks, block_size, Hkv, D], same dtype as `q`; `Hq` a multiple of `Hkv`
    (query head h reads KV head h // (Hq // Hkv)).
  - Query token i of sequence s sits at position `p = seq_lens[s] - query_len(s) + i` and attends to every
    cached key at or before it; with `window` (an int >= 1; Hugging Face transformers' sliding window,
    `sliding_window_causal_mask_function`) only to keys k with `p - window < k <= p`: at most `window` keys,
    itself included. Output [T, Hq, D] in q's dtype (written into `out` when given); softmax in fp32.
  - `softcap` (a float > 0; Gemma 2's attention logit soft-capping, as transformers' eager attention): each
    score `scale * q.k` becomes `softcap * tanh(scale * q.k / softcap)` before masking and softmax.
  - A window < 1 or a softcap <= 0 (or not a number) is a ValueError naming the argument; None: neither.
- `plan_paged_attention(k_cache, meta, num_heads, *, window=None, backend=None) -> AttentionPlan |
  CpuAttentionPlan | None`: the step's layer-independent work (the reference's sequence groups, index
  tensors and visibility masks; the cpu backend's decode rows and block tables besides), built once per step
  and stored as `dataclasses.replace(meta, plan=plan)` for every layer's `paged_attention`; with `meta.plan`
  None the torch and cpu backends build their own on each call. Triton plans nothing (None) and ignores
  `meta.plan`. A plan is valid for the backend and metadata it was built from, caches of that shape and the
  one `window` it records (the masks depend on it): a model whose layers differ in window builds one plan
  per window, and `paged_attention` with another window than its plan's is a ValueError.
- `reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, *, backend=None)`: writes `k`, `v` [T, Hkv, D]
  in place at `slot_mapping[t] = block_id * block_size + offset` (int32 or int64; `meta.slot_mapping` in a
  step); a negative slot is skipped. It takes the slots alone: a cache write needs nothing else.

`backend`: None (or "auto", as in EngineConfig) picks Triton for CUDA tensors; on CPU tensors, "cpu" (the
C++ decode kernel of `kernels/cpu_paged_attention.py` for decodes, the reference for prefill chunks; the
model then also runs the extension's fused element-wise ops, `kernels/cpu_fused.py`) when the C++ CPU
extension (`kernels/cpu_extension.py`) builds on this machine, else "torch" (the PyTorch reference alone).
"triton" or "torch" forces one on any device (Triton on CPU tensors needs `TRITON_INTERPRET=1` set before the
kernel modules are first imported); "cpu" forces the C++ kernels on CPU tensors and is a RuntimeError where
they cannot be built; anything else is a ValueError. The Triton modules are imported only when first
dispatched to, so CPU users need not install triton; the C++ extension is loaded only when first resolved to
(compiled first, tens of seconds, where `python -m conveyor.kernels.prebuild` did not build it). The cpu
backend writes the cache with a C++ row copy.

Checks: wrong shapes, dtypes or devices raise ValueError naming the field (metadata only, no device sync).
The reference also checks the length values (it reads them on the host anyway); the Triton path trusts them,
so a slot or block id beyond the cache is the caller's bug. Any strides are accepted (e.g. q, k, v as views
of a fused QKV projection); the reference is fastest with contiguous caches.
"""

from __future__ import annotations

import torch

from conveyor.kernels.cpu_extension import cpu_kernels
from conveyor.kernels.cpu_paged_attention import (
    CpuAttentionPlan,
    paged_attention_cpu,
    plan_paged_attention_cpu,
    reshape_and_cache_cpu,
)
from conveyor.kernels.metadata import AttentionMetadata
from conveyor.kernels.reference import (
    AttentionPlan,
    check_window_softcap,
    paged_attention_ref,
    plan_paged_attention_ref,
    reshape_and_cache_ref,
)

BACKENDS = ("triton", "torch", "cpu")

__all__ = ["BACKENDS", "AttentionMetadata", "AttentionPlan", "CpuAttentionPlan", "paged_attention",
           "paged_attention_cpu", "paged_attention_ref", "plan_paged_attention", "plan_paged_attention_cpu",
           "plan_paged_attention_ref", "reshape_and_cache", "reshape_and_cache_cpu", "reshape_and_cache_ref",
           "resolve_backend"]


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """The backend for `device`: the forced one, else Triton on CUDA and on CPU the C++ kernels where they
    build (the reference where they do not)."""
    if backend is None or backend == "auto":
        if device.type == "cuda":
            return "triton"
        return "cpu" if device.type == "cpu" and cpu_kernels().module is not None else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "cpu" and device.type != "cpu":
        raise ValueError(f"attention backend 'cpu' runs on CPU tensors; the device is {device}: use 'auto', "
                         "'triton' or 'torch'")
    if backend == "cpu" and cpu_kernels().module is None:
        raise RuntimeError(f"attention backend 'cpu': the C++ CPU kernels could not be built here "
                           f"({cpu_kernels().detail}); use 'torch' or 'auto'")
    return backend


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Attention of the step's queries over the paged cache (see the module docstring); `window`: sliding
    window in keys (None: the whole context), `softcap`: tanh cap of the scaled scores (None: none)."""
    chosen = resolve_backend(backend, q.device)
    if chosen == "torch":
        return paged_attention_ref(q, k_cache, v_cache, meta, scale, out, window=window, softcap=softcap)
    if chosen == "cpu":
        return paged_attention_cpu(q, k_cache, v_cache, meta, scale, out, window=window, softcap=softcap)
    from conveyor.kernels.triton_paged_attention import paged_attention_triton

    return paged_attention_triton(q, k_cache, v_cache, meta, scale, out, window=window, softcap=softcap)


def plan_paged_attention(
    k_cache: torch.Tensor,
    meta: AttentionMetadata,
    num_heads: int,
    *,
    window: int | None = None,
    backend: str | None = None,
) -> AttentionPlan | CpuAttentionPlan | None:
    """The step's attention plan for the layers of sliding window `window` (None: none), to store in
    `meta.plan` for each such layer's `paged_attention`; None where the backend (Triton) plans nothing on the
    host. `meta.plan` itself is not read."""
    check_window_softcap(window, None)
    chosen = resolve_backend(backend, k_cache.device)
    if chosen == "torch":
        return plan_paged_attention_ref(k_cache, meta, num_heads, window=window)
    if chosen == "cpu":
        return plan_paged_attention_cpu(k_cache, meta, num_heads, window=window)
    return None


def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    chosen = resolve_backend(backend, k.device)
    if chosen == "torch":
        reshape_and_cache_ref(k, v, k_cache, v_cache, slot_mapping)
        return
    if chosen == "cpu":
        reshape_and_cache_cpu(k, v, k_cache, v_cache, slot_mapping)
        return
    from conveyor.kernels.triton_cache import reshape_and_cache_triton

    reshape_and_cache_triton(k, v, k_cache, v_cache, slot_mapping)
