"""Input checks shared by every backend: a wrong shape or dtype is a ValueError naming the field.

Only metadata is inspected (shapes, dtypes, devices), never tensor values, so the checks never
synchronise with the device.
"""

from __future__ import annotations

from typing import NoReturn

import torch

from conveyor.kernels.metadata import AttentionMetadata

INDEX_DTYPES = (torch.int32, torch.int64)


def check_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    out: torch.Tensor | None,
) -> None:
    """q, the caches and every metadata field paged attention reads: all but `slot_mapping` and `plan`."""
    block_tables, seq_lens, query_start_loc = meta.block_tables, meta.seq_lens, meta.query_start_loc
    max_query_len, max_seq_len = meta.max_query_len, meta.max_seq_len
    if q.dim() != 3:
        _fail("q", f"must be [T, Hq, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        _fail("k_cache", f"must be [num_blocks, block_size, Hkv, D], got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        _fail("v_cache", f"shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}")
    if not (k_cache.dtype == q.dtype and v_cache.dtype == q.dtype):
        _fail("k_cache/v_cache", f"dtypes {k_cache.dtype}/{v_cache.dtype} differ from q's {q.dtype}")
    if not q.is_floating_point():
        _fail("q", f"must be a floating-point tensor, got {q.dtype}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        _fail("k_cache", f"head dim {k_cache.shape[3]} differs from q's {head_dim}")
    if not (num_kv_heads > 0 and num_heads % num_kv_heads == 0):
        _fail("q", f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if block_tables.dim() != 2:
        _fail("block_tables", f"must be [S, max_blocks], got shape {tuple(block_tables.shape)}")
    num_seqs = block_tables.shape[0]
    if seq_lens.shape != (num_seqs,):
        _fail("seq_lens", f"must be [S] with S={num_seqs}, got shape {tuple(seq_lens.shape)}")
    if query_start_loc.shape != (num_seqs + 1,):
        _fail("query_start_loc",
              f"must be [S + 1] with S={num_seqs}, got shape {tuple(query_start_loc.shape)}")
    indices = (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc))
    for name, t in indices:
        if t.dtype not in INDEX_DTYPES:
            _fail(name, f"must be int32 or int64, got {t.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.device != q.device:
            _fail(name, f"is on {t.device} but q is on {q.device}")
    if max_query_len < 0:
        _fail("max_query_len", f"must be >= 0, got {max_query_len}")
    if max_seq_len < max_query_len:
        _fail("max_seq_len", f"({max_seq_len}) must be >= max_query_len ({max_query_len})")
    capacity = block_tables.shape[1] * k_cache.shape[1]
    if max_seq_len > capacity:
        _fail("max_seq_len", f"({max_seq_len}) exceeds the block tables' capacity "
                             f"({block_tables.shape[1]} blocks x {k_cache.shape[1]} slots)")
    if out is not None and not (out.shape == q.shape and out.dtype == q.dtype and out.device == q.device):
        _fail("out", f"must match q ({tuple(q.shape)}, {q.dtype}, {q.device}), "
             f"got ({tuple(out.shape)}, {out.dtype}, {out.device})")


def check_reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if k.dim() != 3:
        _fail("k", f"must be [T, Hkv, D], got shape {tuple(k.shape)}")
    if v.shape != k.shape:
        _fail("v", f"shape {tuple(v.shape)} differs from k {tuple(k.shape)}")
    if k_cache.dim() != 4:
        _fail("k_cache", f"must be [num_blocks, block_size, Hkv, D], got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        _fail("v_cache", f"shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}")
    if k_cache.shape[2:] != k.shape[1:]:
        _fail("k",
              f"rows [Hkv, D] = {tuple(k.shape[1:])} do not match the cache's {tuple(k_cache.shape[2:])}")
    if slot_mapping.shape != (k.shape[0],):
        _fail("slot_mapping", f"must be [T] with T={k.shape[0]}, got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in INDEX_DTYPES:
        _fail("slot_mapping", f"must be int32 or int64, got {slot_mapping.dtype}")
    if k.dtype != v.dtype:
        _fail("v", f"dtype {v.dtype} differs from k's {k.dtype}")
    if k_cache.dtype != v_cache.dtype:
        _fail("v_cache", f"dtype {v_cache.dtype} differs from k_cache's")
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        if t.device != k.device:
            _fail(name, f"is on {t.device} but k is on {k.device}")


def _fail(name: str, message: str) -> NoReturn:
    """Messages are built only on failure: these checks run for every layer of every step."""
    raise ValueError(f"{name} {message}")
