"""Input checks shared by every backend: a wrong shape or dtype is a ValueError naming the field.

Only metadata is inspected (shapes, dtypes, devices), never tensor values, so the checks never
synchronise with the device.
"""

from __future__ import annotations

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
    _require(q.dim() == 3, "q", f"must be [T, Hq, D], got shape {tuple(q.shape)}")
    _require(k_cache.dim() == 4, "k_cache",
             f"must be [num_blocks, block_size, Hkv, D], got shape {tuple(k_cache.shape)}")
    _require(v_cache.shape == k_cache.shape, "v_cache",
             f"shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}")
    _require(k_cache.dtype == q.dtype and v_cache.dtype == q.dtype, "k_cache/v_cache",
             f"dtypes {k_cache.dtype}/{v_cache.dtype} differ from q's {q.dtype}")
    _require(q.is_floating_point(), "q", f"must be a floating-point tensor, got {q.dtype}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    _require(k_cache.shape[3] == head_dim, "k_cache",
             f"head dim {k_cache.shape[3]} differs from q's {head_dim}")
    _require(num_kv_heads > 0 and num_heads % num_kv_heads == 0, "q",
             f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    _require(block_tables.dim() == 2, "block_tables",
             f"must be [S, max_blocks], got shape {tuple(block_tables.shape)}")
    num_seqs = block_tables.shape[0]
    _require(seq_lens.shape == (num_seqs,), "seq_lens",
             f"must be [S] with S={num_seqs}, got shape {tuple(seq_lens.shape)}")
    _require(query_start_loc.shape == (num_seqs + 1,), "query_start_loc",
             f"must be [S + 1] with S={num_seqs}, got shape {tuple(query_start_loc.shape)}")
    indices = (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc))
    for name, t in indices:
        _require(t.dtype in INDEX_DTYPES, name, f"must be int32 or int64, got {t.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        _require(t.device == q.device, name, f"is on {t.device} but q is on {q.device}")
    _require(max_query_len >= 0, "max_query_len", f"must be >= 0, got {max_query_len}")
    _require(max_seq_len >= max_query_len, "max_seq_len",
             f"({max_seq_len}) must be >= max_query_len ({max_query_len})")
    capacity = block_tables.shape[1] * k_cache.shape[1]
    _require(max_seq_len <= capacity, "max_seq_len",
             f"({max_seq_len}) exceeds the block tables' capacity "
             f"({block_tables.shape[1]} blocks x {k_cache.shape[1]} slots)")
    if out is not None:
        _require(out.shape == q.shape and out.dtype == q.dtype and out.device == q.device, "out",
                 f"must match q ({tuple(q.shape)}, {q.dtype}, {q.device}), "
                 f"got ({tuple(out.shape)}, {out.dtype}, {out.device})")


def check_reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    _require(k.dim() == 3, "k", f"must be [T, Hkv, D], got shape {tuple(k.shape)}")
    _require(v.shape == k.shape, "v", f"shape {tuple(v.shape)} differs from k {tuple(k.shape)}")
    _require(k_cache.dim() == 4, "k_cache",
             f"must be [num_blocks, block_size, Hkv, D], got shape {tuple(k_cache.shape)}")
    _require(v_cache.shape == k_cache.shape, "v_cache",
             f"shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}")
    _require(k_cache.shape[2:] == k.shape[1:], "k",
             f"rows [Hkv, D] = {tuple(k.shape[1:])} do not match the cache's {tuple(k_cache.shape[2:])}")
    _require(slot_mapping.shape == (k.shape[0],), "slot_mapping",
             f"must be [T] with T={k.shape[0]}, got shape {tuple(slot_mapping.shape)}")
    _require(slot_mapping.dtype in INDEX_DTYPES, "slot_mapping",
             f"must be int32 or int64, got {slot_mapping.dtype}")
    _require(k.dtype == v.dtype, "v", f"dtype {v.dtype} differs from k's {k.dtype}")
    _require(k_cache.dtype == v_cache.dtype, "v_cache", f"dtype {v_cache.dtype} differs from k_cache's")
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        _require(t.device == k.device, name, f"is on {t.device} but k is on {k.device}")


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")
